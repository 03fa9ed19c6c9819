"""LoRA adapters of tensor-parallel projections, split with their projection's style.

A projection ``y = W x`` with an adapter adds ``s · B (A x)``. Split the same way as ``W``:

- column-parallel (``W`` ``Shard(0)``: this rank's output rows): ``B`` by rows too
  (``Shard(0)``), ``A`` whole (``Replicate``): each rank computes ``A x`` whole and its rows
  of ``B (A x)`` — the rows of the output it holds;
- row-parallel (``W`` ``Shard(1)``: this rank's input columns, the outputs summed over TP):
  ``A`` by columns (``Shard(1)``), ``B`` whole: ``A_r x_r`` is this rank's part of ``A x``, and
  ``B (A_r x_r)`` is a partial output summed over TP with the base's partial output — the sum
  is ``B (A x)``;
- the Gated DeltaNet's fused ``in_proj_qkv`` (``W`` ``Replicate``, each rank computing its
  heads' rows, :mod:`qwen35_trainer.parallel.tp_gdn`): ``A`` and ``B`` whole, each rank
  computing its rows of ``B``.

The decoder's attention and shared expert run the adapter on DTensors (``LoRALinear``'s own
forward: DTensor's sharding rules give the placements above, and the gradient of a whole
``A`` — a partial sum over the ranks' rows of ``B`` — is summed over TP by DTensor). The Gated
DeltaNet runs on local tensors (:func:`local_adapter`): a whole adapter's gradient there covers
this rank's rows only and is summed over TP explicitly, as the layer's whole weights are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from qwen35_trainer.parallel.tp_comm import sum_grad_over_tp

__all__ = ["local_adapter", "split_adapters"]

# the projection's weight placement → the adapters' (A, B)
_STYLES = {
    Shard(0): (Replicate(), Shard(0)),
    Shard(1): (Shard(1), Replicate()),
    Replicate(): (Replicate(), Replicate()),
}


def _adapted(module: nn.Module) -> bool:
    """Whether ``module`` is a :class:`~qwen35_trainer.model.lora.adapters.LoRALinear` (by its
    adapters: the parallel stage does not import the model stage)."""
    return getattr(module, "lora_A", None) is not None


def split_adapters(model: nn.Module, tp_mesh: DeviceMesh) -> list[str]:
    """Place the adapters of every TP-split LoRA projection of ``model`` on ``tp_mesh`` by
    its weight's placement (module docstring); in place, after the TP plan and the Gated
    DeltaNet split, on the meta model (the values are filled per shard afterwards). Returns
    the adapted projections' names."""
    placed = []
    for name, module in model.named_modules():
        if not _adapted(module) or not isinstance(module.weight, DTensor):
            continue
        (placement,) = module.weight.placements
        a_place, b_place = _STYLES[placement]
        for attr, where in (("lora_A", a_place), ("lora_B", b_place)):
            param = getattr(module, attr)
            whole = torch.empty(param.shape, dtype=param.dtype, device="meta")
            sharded = distribute_tensor(whole, tp_mesh, [where])
            module.register_parameter(
                attr, nn.Parameter(sharded, requires_grad=param.requires_grad)
            )
        placed.append(name)
    return placed


def local_adapter(
    module: nn.Module, weight: torch.Tensor, group: Any, rows: torch.Tensor | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x ↦ W x`` (``weight``: this rank's local weight, already cut to ``rows``) plus, for a
    LoRA projection, its adapter on this rank's local tensors: a whole (replicated) adapter's
    gradient summed over TP, ``B`` cut to ``rows`` like the weight."""
    if not _adapted(module):
        return lambda x: F.linear(x, weight)
    factors = []
    for param in (module.lora_A, module.lora_B):
        local = param.to_local()
        if param.placements == (Replicate(),):
            local = sum_grad_over_tp(local, group)
        factors.append(local)
    a, b = factors
    if rows is not None:
        b = b[rows]
    scale, dropout = module.lora_scale, module.lora_dropout

    def forward(x: torch.Tensor) -> torch.Tensor:
        x_in = F.dropout(x, dropout, module.training) if dropout else x
        adapter = F.linear(F.linear(x_in, a.to(x.dtype)), b.to(x.dtype))
        return F.linear(x, weight) + scale * adapter

    return forward
