"""Shared builders for the tests: a tiny MoE and inputs with a zero-token expert."""

from __future__ import annotations

import torch

from moe_parallel import LoRASpec, MoE, add_expert_lora, quantize_experts

HIDDEN, EXPERTS, TOP_K, INTER, SHARED = 16, 8, 2, 8, 8
IDLE_EXPERT = 7


def tiny_moe(seed: int = 0) -> MoE:
    """8 experts top-2, hidden 16; expert 7 is never chosen for inputs from :func:`tokens`."""
    torch.manual_seed(seed)
    moe = MoE(HIDDEN, EXPERTS, TOP_K, INTER, SHARED, init_std=0.3)
    with torch.no_grad():
        moe.gate.weight[:, 0] = 0.5
        moe.gate.weight[IDLE_EXPERT, 0] = -4.0
    return moe


def tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    """[B, S, H] random tokens whose feature 0 is large, which keeps ``IDLE_EXPERT`` idle."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, HIDDEN, generator=g)
    x[..., 0] = 3.0
    return x


LORA = LoRASpec(rank=4, alpha=6.0)


def lora_moe(seed: int = 0, spec: LoRASpec = LORA, fp8_block=None) -> MoE:
    """:func:`tiny_moe` with expert adapters whose ``B`` is random (so every adapter has a
    gradient), the experts' own weights frozen (held in FP8 with ``fp8_block``)."""
    moe = tiny_moe(seed)
    if fp8_block is not None:
        quantize_experts(moe, fp8_block)
    add_expert_lora(moe, spec)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in (moe.experts.lora_gate_up_B, moe.experts.lora_down_B):
            b.copy_(0.3 * torch.randn(b.shape, generator=g))
    moe.experts.gate_up_proj.requires_grad_(False)
    moe.experts.down_proj.requires_grad_(False)
    return moe
