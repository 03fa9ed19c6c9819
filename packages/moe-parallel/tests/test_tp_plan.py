"""TP plan validation: wildcards expanded, zero-match and expert/router paths rejected."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from moe_parallel import MoE, validate_tp_plan

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf  # noqa: E402
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (  # noqa: E402
    Qwen3_5MoeTextConfig,
)


class Decoder(nn.Module):
    def __init__(self, hf_blocks: bool = False) -> None:
        super().__init__()
        cfg = Qwen3_5MoeTextConfig(
            hidden_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
        )
        make = (
            (lambda: hf.Qwen3_5MoeSparseMoeBlock(cfg))
            if hf_blocks
            else (lambda: MoE.from_config(cfg))
        )
        self.layers = nn.ModuleList(
            nn.ModuleDict({"attn": nn.Linear(16, 16), "mlp": make()}) for _ in range(2)
        )


@pytest.mark.parametrize("hf_blocks", [False, True], ids=["ours", "transformers"])
def test_wildcards_expand_to_allowed_paths(hf_blocks):
    plan = {
        "layers.*.attn": ColwiseParallel(),
        "layers.*.mlp.shared_expert.down_proj": RowwiseParallel(),
        "layers.*.mlp.shared_expert.[gu]*_proj": ColwiseParallel(),
    }
    got = validate_tp_plan(Decoder(hf_blocks), plan)
    assert list(got) == [
        "layers.0.attn",
        "layers.0.mlp.shared_expert.gate_proj",
        "layers.0.mlp.shared_expert.up_proj",
        "layers.0.mlp.shared_expert.down_proj",
        "layers.1.attn",
        "layers.1.mlp.shared_expert.gate_proj",
        "layers.1.mlp.shared_expert.up_proj",
        "layers.1.mlp.shared_expert.down_proj",
    ]
    assert got["layers.1.attn"] is plan["layers.*.attn"]


@pytest.mark.parametrize("hf_blocks", [False, True], ids=["ours", "transformers"])
@pytest.mark.parametrize(
    ("pattern", "offending"),
    [
        ("layers.*.mlp.experts", "layers.0.mlp.experts"),
        ("layers.*.mlp.gate", "layers.0.mlp.gate"),
        ("*gate*", "layers.0.mlp.gate"),
        ("layers.1.mlp", "layers.1.mlp"),
        ("layers.*", "layers.0"),
    ],
)
def test_expert_and_router_paths_rejected(hf_blocks, pattern, offending):
    with pytest.raises(
        ValueError,
        match=rf"{pattern!r} reaches {offending!r}".replace("*", r"\*").replace(".", r"\."),
    ):
        validate_tp_plan(Decoder(hf_blocks), {pattern: ColwiseParallel()})


def test_zero_match_and_bad_types_rejected():
    with pytest.raises(ValueError, match=r"'layers\.\*\.self_attn' matches no module"):
        validate_tp_plan(Decoder(), {"layers.*.self_attn": ColwiseParallel()})
    with pytest.raises(TypeError, match="ParallelStyle"):
        validate_tp_plan(Decoder(), {"layers.*.attn": "colwise"})
    with pytest.raises(TypeError, match="non-empty mapping"):
        validate_tp_plan(Decoder(), {})
    with pytest.raises(ValueError, match="matched by both"):
        validate_tp_plan(
            Decoder(), {"layers.0.attn": ColwiseParallel(), "layers.*.attn": ColwiseParallel()}
        )


def test_transformers_experts_leave_none_grads_without_tokens_ours_zero():
    """Negative control for the zero-token guard: transformers' loop over hit experts leaves the
    expert weights out of the graph when no row reaches them (grad None); ours gives zeros."""
    cfg = Qwen3_5MoeTextConfig(
        hidden_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
    )
    theirs, ours = hf.Qwen3_5MoeExperts(cfg), MoE.from_config(cfg).experts
    for p in theirs.parameters():
        nn.init.normal_(p)
    x, idx, w = (
        torch.randn(0, 16, requires_grad=True),
        torch.zeros(0, 2, dtype=torch.long),
        torch.zeros(0, 2),
    )
    (theirs(x, idx, w).sum() + x.sum()).backward()
    assert theirs.gate_up_proj.grad is None
    ours(x, idx).sum().backward()
    assert torch.equal(ours.gate_up_proj.grad, torch.zeros_like(ours.gate_up_proj))
    assert torch.equal(ours.down_proj.grad, torch.zeros_like(ours.down_proj))
