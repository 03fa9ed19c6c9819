"""``packed_gated_deltanet_forward``: transformers' Qwen3.5 Gated DeltaNet layer on packed documents.

It reproduces ``Qwen3_5MoeGatedDeltaNet.forward`` (no cache) step by step — ``in_proj_qkv`` →
depthwise causal conv + SiLU → split into q/k/v heads; ``beta = sigmoid(in_proj_b)``;
``g = -exp(A_log)·softplus(in_proj_a + dt_bias)`` in fp32; the gated delta rule with q/k
L2-normalised and repeated to the value heads; the layer's gated RMSNorm with ``in_proj_z``;
``out_proj`` — with the two sequence-mixing steps replaced by :func:`causal_conv1d` and
:func:`gated_delta_rule`, which restart at every document and run under CP. Everything else is
per token, so it is unchanged by packing or sharding. Only the layer's own modules and
parameters are used (duck-typed: transformers is not imported).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_varlen_attn.conv import causal_conv1d
from cp_varlen_attn.gated_delta import gated_delta_rule
from cp_varlen_attn.layout import CPLayout

__all__ = ["GDN_ATTRIBUTES", "packed_gated_deltanet_forward"]

# What this forward reads from transformers' layer (checked before a model is adapted).
GDN_ATTRIBUTES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log",
                  "dt_bias", "norm", "out_proj", "key_dim", "value_dim", "num_k_heads",
                  "num_v_heads", "head_k_dim", "head_v_dim", "activation")  # fmt: skip


def packed_gated_deltanet_forward(
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    layout: CPLayout | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Forward of a ``Qwen3_5MoeGatedDeltaNet`` layer over packed documents.

    Args:
        layer: the transformers layer (``in_proj_qkv/z/b/a``, ``conv1d``, ``A_log``, ``dt_bias``,
            ``norm``, ``out_proj`` and the head sizes).
        hidden_states: [1, T, hidden] (this rank's tokens in layout order under CP).
        cu_seqlens: int [N + 1] document boundaries without a layout.
        layout, group: CP layout and process group.
    Returns:
        [1, T, hidden], equal to running the layer on each document separately.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(
            f"hidden_states must be one packed sequence [1, T, hidden], got {tuple(hidden_states.shape)}"
        )
    if layer.activation != "silu":
        raise ValueError(
            f"the layer's conv activation must be 'silu' (Qwen3.5), got {layer.activation!r}"
        )
    _, seq, _ = hidden_states.shape
    mixed_qkv = causal_conv1d(
        layer.in_proj_qkv(hidden_states),
        layer.conv1d.weight,
        layer.conv1d.bias,
        cu_seqlens=cu_seqlens,
        layout=layout,
        group=group,
        activation="silu",
    )
    query, key, value = torch.split(
        mixed_qkv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1
    )
    query = query.reshape(1, seq, layer.num_k_heads, layer.head_k_dim)
    key = key.reshape(1, seq, layer.num_k_heads, layer.head_k_dim)
    value = value.reshape(1, seq, layer.num_v_heads, layer.head_v_dim)
    z = layer.in_proj_z(hidden_states).reshape(-1, layer.head_v_dim)
    beta = layer.in_proj_b(hidden_states).sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(
        layer.in_proj_a(hidden_states).float() + layer.dt_bias
    )
    core, _ = gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=True,
        layout=layout,
        group=group,
        backend=backend,
    )
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z).reshape(1, seq, -1)
    return layer.out_proj(core)
