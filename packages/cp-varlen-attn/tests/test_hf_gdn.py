"""packed_gated_deltanet_forward on one rank: a tiny transformers Qwen3_5MoeGatedDeltaNet run on
each document separately equals one packed run through this package (output and every
parameter's gradient) — unlike the layer itself run on the packed sequence, which leaks state."""

from __future__ import annotations

import itertools

import pytest
import torch
from gdn_reference import cu_from_lengths

from cp_varlen_attn import packed_gated_deltanet_forward


def _tiny_layer():
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    config = Qwen3_5MoeTextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    layer = Qwen3_5MoeGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        layer.norm.weight.normal_(1.0, 0.1)
    return layer


def test_packed_layer_equals_layer_per_document():
    layer = _tiny_layer()
    lengths = [1, 80, 3, 20]
    cu = cu_from_lengths(lengths)
    hidden = torch.randn(1, sum(lengths), 32, generator=torch.Generator().manual_seed(1))
    ref = torch.cat([layer(hidden[:, s:e]) for s, e in itertools.pairwise(cu)], dim=1)
    out = packed_gated_deltanet_forward(layer, hidden, cu_seqlens=cu)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    leaky = layer(hidden)  # the layer alone on the packed sequence mixes documents
    assert (leaky - ref).abs().max() > 1e-3
    got = torch.autograd.grad(out.square().sum(), list(layer.parameters()))
    want = torch.autograd.grad(ref.square().sum(), list(layer.parameters()))
    for (name, _), a, b in zip(layer.named_parameters(), got, want, strict=True):
        torch.testing.assert_close(
            a, b, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"grad {name}: {m}"
        )


def test_packed_layer_refuses_a_batch():
    with pytest.raises(ValueError, match=r"\[1, T, hidden\]"):
        packed_gated_deltanet_forward(_tiny_layer(), torch.randn(2, 5, 32))
