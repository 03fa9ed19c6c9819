"""Gradient-norm clipping over parameters that live on several device meshes.

A model parallelised several ways holds its parameters on different meshes: under expert
parallelism the dense parameters are DTensors on the FSDP mesh and the experts on the expert
mesh (FSDP × EP); under TP the sharded weights add a TP dim. ``torch.nn.utils.clip_grad_norm_``
stacks the per-parameter norms into one tensor and cannot mix DTensors of different meshes.

Correctness argument: the total norm is ``sqrt(sum over parameters of ||grad||^2)``. The
gradients are grouped by mesh and placements. In a group each rank sums the squares of its
local shards; a ``Shard`` dim holds disjoint pieces, so the sum over that dim's ranks counts
every element once, and a ``Replicate`` dim holds copies, so it is not summed over. ONE
all-reduce per group, over the sharded dims flattened into one group, gives the group's squared
norm, the same number on every rank (DTensor's own reduction of a norm sharded on two dims runs
two sequential all-reduces and warns that the result may differ between ranks). A group with a
``Partial`` gradient, or sharded on several dims of a mesh that cannot be flattened (dims
without names, or already flattened), is reduced by DTensor itself (``full_tensor``). Summing the groups gives the global squared norm on every rank, so every rank
scales by the same coefficient, as one process would. Plain tensors (one process) are grouped
by device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_compat.mesh import flatten_mesh

__all__ = ["clip_grad_norm"]


def _check_max_norm(max_norm: float | None) -> None:
    if max_norm is None:
        return
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"max_norm must be a positive number or None, got {max_norm!r}")
    if not max_norm > 0 or math.isnan(max_norm):
        raise ValueError(
            f"max_norm must be > 0 (None: measure the norm without clipping), got {max_norm!r}; "
            "0 would zero every gradient and a negative value would flip their sign"
        )


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float | None,
    *,
    across: Any = None,
    device: torch.device | str | None = None,
) -> float:
    """Scale the gradients of ``params`` so their total L2 norm is at most ``max_norm``.

    ``params`` may mix plain tensors and DTensors on any number of meshes (shards, replicas).
    ``max_norm=None`` (or ``inf``) only measures. Returns the total norm BEFORE clipping, the
    same float on every rank; a non-finite norm is returned and leaves the gradients
    unscaled (the caller decides to skip the step).

    ``across``: a process group whose ranks hold OTHER parameters of the same model (pipeline
    stages): their squared norms are summed over it (one all-reduce of a tensor on ``device``,
    the group's device), so each parameter counts once in the total and every rank of the
    group clips by the same norm. ``params`` then must be this rank's parameters only, each
    mesh's shards counted once by its own reduction as usual.

    Raises:
        TypeError / ValueError: ``max_norm`` is not a positive number or ``None``.
    """
    _check_max_norm(max_norm)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if not p.requires_grad:
            continue
        # a gradient's own placements (a replicated weight's may be Partial); without one the
        # parameter's, which megatron-fsdp's gradients share, so every rank has every group
        t = p if p.grad is None else p.grad
        key = (t.device_mesh, tuple(t.placements)) if isinstance(t, DTensor) else t.device
        group = groups.setdefault(key, [])
        if p.grad is not None:
            group.append(p.grad)
    grads = [g for group in groups.values() for g in group]
    total_sq = sum(float(_squared_norm(key, group)) for key, group in groups.items())
    if across is not None:
        summed = torch.tensor([total_sq], dtype=torch.float64, device=device)
        dist.all_reduce(summed, group=across)
        total_sq = float(summed)
    total = math.sqrt(total_sq)
    if max_norm is not None and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total


def _squared_norm(key: object, group: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squared norms of ``group``, the gradients of the parameters of ``key``
    (one mesh and placements, or one device for plain tensors), the same value on every rank of
    the mesh. A rank may hold none of them (megatron-fsdp leaves ``.grad`` unset where its
    shard is empty): it adds zero, and still joins the group's all-reduce."""
    if not isinstance(key, tuple):
        return _local_squares(group)
    mesh, placements = key
    # every dim that does not replicate: Shard, and FSDP's _StridedShard (not an is_shard())
    sharded = [i for i, p in enumerate(placements) if not p.is_replicate()]
    names = mesh.mesh_dim_names or ()
    root_names = mesh._get_root_mesh().mesh_dim_names or ()
    flattenable = len(sharded) < 2 or (names and set(names) <= set(root_names))
    if group and (any(p.is_partial() for p in placements) or not flattenable):
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in group])
        return (torch.linalg.vector_norm(norms) ** 2).full_tensor()
    squares = _local_squares([g.to_local() for g in group], mesh.device_type)
    if len(sharded) == 1:
        dist.all_reduce(squares, group=mesh.get_group(sharded[0]))
    elif sharded:
        dims = [names[i] for i in sharded]
        dist.all_reduce(squares, group=flatten_mesh(mesh, dims).get_group())
    return squares


def _local_squares(tensors: list[torch.Tensor], device: torch.device | None = None):
    if not tensors:
        return torch.zeros((), device=device)
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors])
    return torch.linalg.vector_norm(norms) ** 2
