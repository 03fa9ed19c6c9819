"""Gated DeltaNet layers split over tensor-parallel ranks, whole heads per rank.

Rank ``r`` of ``tp`` holds key heads ``[r·Hk/tp, (r+1)·Hk/tp)`` and value heads
``[r·Hv/tp, (r+1)·Hv/tp)``; value head ``j`` reads key head ``j // (Hv/Hk)`` (q/k are repeated
to the value heads in order), so a rank's value heads use exactly its key heads and the gated
delta rule of each head runs on one rank, with no exchange between TP ranks. Under CP the
state summaries and conv tails are exchanged between the CP ranks of the SAME TP index, which
hold the same heads: the recurrence of every head is the one-process recurrence (GDN exact under
TP × CP).

Parameters stay DTensors on the TP mesh with the transformers names and shapes (checkpoints
and exports do not depend on ``tp``):

- per value head, contiguous in their tensors: ``in_proj_z``, ``in_proj_b``, ``in_proj_a``
  (rows), ``A_log``, ``dt_bias`` — ``Shard(0)``; ``out_proj`` — ``Shard(1)`` (row-parallel:
  partial outputs summed over TP in the forward);
- ``in_proj_qkv`` and the depthwise ``conv1d`` are FUSED [q | k | v] along their rows /
  channels, so a rank's heads are three separate row ranges: they are stored ``Replicate``
  (FSDP still shards them over the data ranks) and each rank computes with its own rows only —
  the projection and the convolution of its heads, never the others'. ``norm.weight`` (one
  vector shared by all heads) is ``Replicate`` too. Their gradients on a rank cover its heads'
  rows (the norm: its heads' contribution) and are SUMMED over TP in the backward, which gives
  the full gradient on every TP rank;
- the layer's input is replicated over TP; the gradient w.r.t. it is each rank's heads'
  contribution, also summed over TP in the backward. Under sequence parallelism the input is
  this rank's slice of the tokens: it is all-gathered (the backward reduce-scatters: the same
  sum, each rank keeping its slice) and ``out_proj``'s partial outputs are reduce-scattered
  instead of summed whole (:mod:`qwen35_trainer.parallel.sequence_parallel`).

The layer then runs cp-varlen-attn's packed forward (duck-typed on the layer) on a view that
holds this rank's local weights and head counts, so TP needs packed rows. A projection with a
LoRA adapter computes it on the same local tensors (:mod:`qwen35_trainer.parallel.tp_lora`).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.func import functional_call

from cp_varlen_attn.hf_gdn import packed_gated_deltanet_forward
from qwen35_trainer.parallel.sequence_parallel import (
    gather_from_sequence,
    reduce_scatter_to_sequence,
)
from qwen35_trainer.parallel.tp_comm import sum_grad_over_tp, sum_over_tp
from qwen35_trainer.parallel.tp_lora import local_adapter

__all__ = ["GDN_TP_PLACEMENTS", "qkv_rows", "split_gated_deltanet"]

GDN_TP_PLACEMENTS = {
    "in_proj_qkv.weight": Replicate(),
    "conv1d.weight": Replicate(),
    "norm.weight": Replicate(),
    "in_proj_z.weight": Shard(0),
    "in_proj_b.weight": Shard(0),
    "in_proj_a.weight": Shard(0),
    "A_log": Shard(0),
    "dt_bias": Shard(0),
    "out_proj.weight": Shard(1),
}


def qkv_rows(
    num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int, rank: int, tp: int
) -> torch.Tensor:
    """The rows of the fused [q | k | v] projection (and conv channels) rank ``rank`` computes:
    its q heads, its k heads, its v heads, in that order."""
    key_dim, qk = num_k_heads * head_k_dim, num_k_heads * head_k_dim // tp
    vd = num_v_heads * head_v_dim // tp
    return torch.cat(
        [
            torch.arange(rank * qk, (rank + 1) * qk),
            key_dim + torch.arange(rank * qk, (rank + 1) * qk),
            2 * key_dim + torch.arange(rank * vd, (rank + 1) * vd),
        ]
    )


def _check(layer: nn.Module, tp: int) -> None:
    uneven = {
        k: getattr(layer, k) for k in ("num_k_heads", "num_v_heads") if getattr(layer, k) % tp
    }
    if uneven:
        raise ValueError(
            f"parallel.tp={tp} must divide the Gated DeltaNet head counts so each rank holds "
            f"whole heads; the layer has {uneven} (model.text.linear_num_key_heads / "
            "linear_num_value_heads)"
        )
    biased = [
        n
        for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "out_proj")
        if getattr(layer, n).bias is not None
    ]
    if biased:
        raise ValueError(
            f"TP-split Gated DeltaNet expects bias-free projections; {biased} have one"
        )


def split_gated_deltanet(
    layer: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False
) -> None:
    """Place ``layer``'s parameters on ``tp_mesh`` (:data:`GDN_TP_PLACEMENTS`) and make it
    run its heads only; in place. The layer must already be adapted for packing.
    ``sequence_parallel``: its input and output hold this rank's slice of the tokens."""
    tp = tp_mesh.size()
    _check(layer, tp)
    for path, placement in GDN_TP_PLACEMENTS.items():
        owner, _, name = path.rpartition(".")
        module = layer.get_submodule(owner) if owner else layer
        param = getattr(module, name)
        sharded = distribute_tensor(param.data, tp_mesh, [placement])
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    rank = tp_mesh.get_local_rank()
    rows = qkv_rows(
        layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim, rank, tp
    )
    layer.forward = functools.partial(
        _tp_packed_forward, layer, tp_mesh.get_group(), rows, tp, sequence_parallel
    )


def _local_view(layer: nn.Module, group: Any, rows: torch.Tensor, tp: int, sp: bool):
    """The attributes cp-varlen-attn's packed forward reads, for this rank's heads only."""
    rows = rows.to(layer.A_log.device)
    qkv_W = sum_grad_over_tp(layer.in_proj_qkv.weight.to_local(), group)[rows]
    conv_W = sum_grad_over_tp(layer.conv1d.weight.to_local(), group)[rows]
    norm_W = sum_grad_over_tp(layer.norm.weight.to_local(), group)

    def linear(module):  # with its LoRA adapter, where it has one (tp_lora)
        return local_adapter(module, module.weight.to_local(), group)

    out_proj = linear(layer.out_proj)
    return types.SimpleNamespace(
        in_proj_qkv=local_adapter(layer.in_proj_qkv, qkv_W, group, rows),
        in_proj_z=linear(layer.in_proj_z),
        in_proj_b=linear(layer.in_proj_b),
        in_proj_a=linear(layer.in_proj_a),
        conv1d=types.SimpleNamespace(weight=conv_W, bias=None),
        A_log=layer.A_log.to_local(),
        dt_bias=layer.dt_bias.to_local(),
        norm=lambda core, z: functional_call(layer.norm, {"weight": norm_W}, (core, z)),
        out_proj=lambda x: (reduce_scatter_to_sequence if sp else sum_over_tp)(out_proj(x), group),
        key_dim=layer.key_dim // tp,
        value_dim=layer.value_dim // tp,
        num_k_heads=layer.num_k_heads // tp,
        num_v_heads=layer.num_v_heads // tp,
        head_k_dim=layer.head_k_dim,
        head_v_dim=layer.head_v_dim,
        activation=layer.activation,
    )


def _tp_packed_forward(
    layer,
    group,
    rows,
    tp,
    sp,
    hidden_states,
    cache=None,
    attention_mask=None,
    *,
    cp_layout=None,
    cp_group=None,
    **kwargs,
):
    """The layer's forward on packed rows (transformers' call signature), this rank's heads."""
    if cp_layout is None:
        raise ValueError("a TP-split Gated DeltaNet layer runs on packed rows: cp_layout= missing")
    if cache is not None:
        raise ValueError("packed documents run without a cache (use_cache=False)")
    if sp:
        hidden_states = gather_from_sequence(hidden_states, group)
    else:
        hidden_states = sum_grad_over_tp(hidden_states, group)
    if attention_mask is not None:  # whole padding documents only (checked by the text model hook)
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    view = _local_view(layer, group, rows, tp, sp)
    return packed_gated_deltanet_forward(
        view,
        hidden_states,
        layout=cp_layout,
        group=cp_group,
        backend=getattr(layer, "gdn_backend", "auto"),
    )
