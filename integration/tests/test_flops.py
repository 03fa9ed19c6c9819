"""The FLOP model behind ``mfu`` against an independent count: every weight-bearing module of
the built model, with the tokens that pass through it, plus the attention / recurrence terms
counted by explicit loops — in total and kind by kind (the step-time model's breakdown, also
restricted to a pipeline stage's part); and MFU only where a peak is known."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny
from torch import nn

from moe_parallel.moe import Experts
from qwen35_trainer import build_model, train
from qwen35_trainer.model.flops import KINDS, forward_flops, peak_flops, training_flops

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


# module path -> kind of forward_flops (first match wins)
_KIND_OF_PATH = (
    ("visual", "vision"),
    ("experts", "experts"),
    ("mlp.", "shared_expert"),  # the router, the shared expert and its gate
    ("self_attn", "attention"),
    ("linear_attn", "gdn"),
    ("mtp.fc", "mtp"),
    ("lm_head", "loss"),
)


def _walked_by_kind(model, docs, grids, layer_indices=None, mtp=True, head=True, tower=True):
    """The independent count kind by kind (:data:`_KIND_OF_PATH`) of the modules of the
    decoder layers ``layer_indices`` (all when None), the MTP head (``mtp``), the ``lm_head``
    (``head``: once, and once more per MTP depth when ``mtp``) and the tower (``tower``)."""
    text, vision = model.config.text_config, model.config.vision_config
    tokens, merge = sum(docs), vision.spatial_merge_size**2
    patches = sum(t * h * w for t, h, w in grids)
    depth = len(model.mtp.layers) if mtp and hasattr(model, "mtp") else 0
    layers = range(len(text.layer_types)) if layer_indices is None else layer_indices
    counts = dict.fromkeys(KINDS, 0)
    for path, module in model.named_modules():
        if isinstance(module, Experts):
            weights = (
                (module.gate_up_proj.numel() + module.down_proj.numel())
                * text.num_experts_per_tok
                // text.num_experts
            )
        elif isinstance(module, nn.Linear | nn.Conv1d | nn.Conv3d) or (
            type(module).__name__ == "Qwen3_5MoeTopKRouter"
        ):
            weights = module.weight.numel()
        else:
            continue
        parts = path.split(".")
        decoder = "layers" in parts and not path.startswith("mtp.")
        if decoder and int(parts[parts.index("layers") + 1]) not in layers:
            continue
        if (path.startswith("mtp.") and not depth) or ("visual" in path and not tower):
            continue
        if path == "lm_head":
            weights *= int(head) + depth
        if path == "mtp.fc":  # shared by the depths: it runs once per depth
            weights *= depth
        kind = next(k for key, k in _KIND_OF_PATH if key in path)
        through = patches // merge if "merger" in path else patches if "visual" in path else tokens
        counts[kind] += 2 * weights * through
    heads_dim = text.num_attention_heads * text.head_dim
    state = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim
    for kind in [*(text.layer_types[i] for i in layers), *["full_attention"] * depth]:
        if kind == "full_attention":
            for n in docs:  # query i sees keys 0..i of its document
                counts["attention_core"] += sum(4 * heads_dim * (i + 1) for i in range(n))
        else:
            counts["gdn_core"] += tokens * 6 * state
    for t, h, w in grids if tower else []:
        counts["vision_core"] += vision.depth * t * 4 * vision.hidden_size * (h * w) ** 2
    return counts


@pytest.mark.parametrize("mtp_layers", [0, 2])
def test_forward_flops_by_kind_equal_the_walked_modules(mtp_layers):
    """Each kind of the whole model, and of a pipeline stage's part: the middle decoder layers
    only (no head, MTP or tower), then the last layers with the head and the MTP head."""
    model = build_model(tiny(f"model.mtp_layers={mtp_layers}").model)
    types = model.config.text_config.layer_types
    assert forward_flops(model.config, DOCS, GRIDS) == _walked_by_kind(model, DOCS, GRIDS)
    middle = forward_flops(model.config, DOCS, [], layer_types=types[1:3], mtp=0, head=False)
    assert middle == _walked_by_kind(model, DOCS, GRIDS, [1, 2], False, False, False)
    last = forward_flops(model.config, DOCS, [], layer_types=types[2:])
    assert last == _walked_by_kind(model, DOCS, GRIDS, range(2, len(types)), tower=False)
    assert 3.0 * sum(forward_flops(model.config, DOCS, GRIDS).values()) == training_flops(
        model.config, DOCS, GRIDS
    )


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
