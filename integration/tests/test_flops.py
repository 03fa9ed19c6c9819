"""The FLOP model behind ``mfu`` against an independent count: every weight-bearing module of
the built model, with the tokens that pass through it, plus the attention / recurrence terms
counted by explicit loops; and MFU only where a peak is known."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny
from torch import nn

from moe_parallel.moe import Experts
from qwen35_trainer import build_model, train
from qwen35_trainer.model.flops import peak_flops, training_flops

DOCS = [30, 7, 51]
GRIDS = [[1, 4, 4], [2, 4, 8]]


def _walked_forward(model, docs, grids) -> int:
    """2 FLOPs per weight per token through each module (experts: top-k of E), biases and
    norms left out, by module path: text modules see every token, vision blocks and the patch
    embedding every patch, the merger every merged token; the MTP head (its modules walked with
    the rest) runs the shared ``lm_head`` once more per depth and its shared ``fc`` once per
    depth (walked once), and each of its attention layers adds its pairs."""
    text, vision = model.config.text_config, model.config.vision_config
    tokens = sum(docs)
    patches = sum(t * h * w for t, h, w in grids)
    merge = vision.spatial_merge_size**2
    total = 0
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv3d):
            weights = module.weight.numel()
        elif isinstance(module, Experts):
            weights = (
                (module.gate_up_proj.numel() + module.down_proj.numel())
                * text.num_experts_per_tok
                // text.num_experts
            )
        elif type(module).__name__ == "Qwen3_5MoeTopKRouter":
            weights = module.weight.numel()
        else:
            continue
        through = patches // merge if "merger" in path else patches if "visual" in path else tokens
        total += 2 * weights * through
    heads_dim = text.num_attention_heads * text.head_dim
    depth = len(model.mtp.layers) if hasattr(model, "mtp") else 0
    if depth:
        shared = depth * model.lm_head.weight.numel() + (depth - 1) * model.mtp.fc.weight.numel()
        total += 2 * shared * tokens
    for kind in [*text.layer_types, *["full_attention"] * depth]:
        if kind == "full_attention":
            for n in docs:  # query i sees keys 0..i of its document
                total += sum(4 * heads_dim * (i + 1) for i in range(n))
        else:
            total += (
                tokens
                * 6
                * text.linear_num_value_heads
                * text.linear_key_head_dim
                * text.linear_value_head_dim
            )
    for t, h, w in grids:  # each frame's patches attend to each other, in every block
        total += vision.depth * t * 4 * vision.hidden_size * (h * w) ** 2
    return total


@pytest.mark.parametrize("mtp_layers", [0, 2])
def test_training_flops_equal_three_forwards_of_an_independent_count(mtp_layers):
    model = build_model(tiny(f"model.mtp_layers={mtp_layers}").model)
    assert hasattr(model, "mtp") == bool(mtp_layers)
    assert training_flops(model.config, DOCS, GRIDS) == 3 * _walked_forward(model, DOCS, GRIDS)


def test_peak_flops_is_unknown_on_cpu_unless_given(monkeypatch):
    assert peak_flops(torch.device("cpu")) is None
    monkeypatch.setenv("QWEN35_PEAK_FLOPS", "1e12")
    assert peak_flops(torch.device("cpu")) == 1e12


def test_mfu_is_logged_when_a_peak_is_known(monkeypatch):
    assert train(tiny("train.steps=1")).logs[0].mfu is None  # CPU: no datasheet peak
    monkeypatch.setenv("QWEN35_PEAK_FLOPS", "1e12")
    log = train(tiny("train.steps=1")).logs[0]
    assert 0 < log.mfu < 1
