"""Shape discovery on transformers' own Qwen3.5-MoE Gated DeltaNet layer.

The reference is the layer itself: its forward is run with the module-level chunked
gated-delta-rule function wrapped to record the q/k/v shapes and dtype it is called with.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from setup_prewarm import GDNShape, find_gdn_shapes, is_gdn_layer

modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
configuration = pytest.importorskip("transformers.models.qwen3_5_moe.configuration_qwen3_5_moe")
ORIGINAL_KERNEL = modeling.torch_chunk_gated_delta_rule


def tiny_config(**overrides):
    sizes = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"],
        pad_token_id=0,
    )
    sizes.update(overrides)
    return configuration.Qwen3_5MoeTextConfig(**sizes)


def seen_by_kernel(layer: nn.Module, dtype: torch.dtype, monkeypatch) -> list[GDNShape]:
    seen = []

    def recording(query, key, value, *args, **kwargs):
        seen.append(
            GDNShape(query.shape[2], value.shape[2], query.shape[3], value.shape[3], query.dtype)
        )
        return ORIGINAL_KERNEL(query, key, value, *args, **kwargs)

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", recording)
    layer(torch.randn(1, 5, layer.hidden_size, dtype=dtype))
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qwen35_gdn_layer_shapes(dtype, monkeypatch):
    torch.manual_seed(0)
    layer = modeling.Qwen3_5MoeGatedDeltaNet(tiny_config(), layer_idx=0).to(dtype)
    assert is_gdn_layer(layer)
    found = find_gdn_shapes(nn.ModuleDict({"layers": nn.ModuleList([layer])}))
    assert found == [GDNShape(2, 4, 8, 8, dtype)]
    assert found == seen_by_kernel(layer, dtype, monkeypatch)


def test_qwen35_layers_of_two_sizes_are_both_found(monkeypatch):
    small = modeling.Qwen3_5MoeGatedDeltaNet(tiny_config(), layer_idx=0)
    wide = modeling.Qwen3_5MoeGatedDeltaNet(
        tiny_config(linear_num_value_heads=2, linear_value_head_dim=16), layer_idx=0
    )
    model = nn.ModuleList([small, wide, small])
    found = find_gdn_shapes(model)
    assert found == seen_by_kernel(small, torch.float32, monkeypatch) + seen_by_kernel(
        wide, torch.float32, monkeypatch
    )
    assert found == [GDNShape(2, 4, 8, 8, torch.float32), GDNShape(2, 2, 8, 16, torch.float32)]
