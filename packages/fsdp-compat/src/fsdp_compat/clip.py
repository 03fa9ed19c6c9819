"""Gradient-norm clipping over parameters that live on several device meshes.

A model parallelised several ways holds its parameters on different meshes: under expert
parallelism the dense parameters are DTensors on the FSDP mesh and the experts on the expert
mesh (FSDP × EP); under TP the sharded weights add a TP dim. ``torch.nn.utils.clip_grad_norm_``
stacks the per-parameter norms into one tensor and cannot mix DTensors of different meshes.

Correctness argument: the total norm is ``sqrt(sum over parameters of ||grad||^2)``. Per mesh,
the squared norms are summed with DTensor arithmetic (``vector_norm`` of a sharded DTensor is a
``Partial`` result, so every shard counts once and a replica is not counted twice), and each
mesh's sum is materialised with ``full_tensor``, which reduces over exactly that mesh's ranks
and gives the same number on every rank. Summing the per-mesh values gives the global squared
norm on every rank, so every rank scales by the same coefficient, as one process would. Plain
tensors (one process) are grouped by device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

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
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Scale the gradients of ``params`` so their total L2 norm is at most ``max_norm``.

    ``params`` may mix plain tensors and DTensors on any number of meshes (shards, replicas).
    ``max_norm=None`` (or ``inf``) only measures. Returns the total norm BEFORE clipping, the
    same float on every rank; a non-finite norm is returned and leaves the gradients
    unscaled (the caller decides to skip the step).

    Raises:
        TypeError / ValueError: ``max_norm`` is not a positive number or ``None``.
    """
    _check_max_norm(max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = g.device_mesh if isinstance(g, DTensor) else g.device
        by_mesh.setdefault(key, []).append(g)
    total_sq = 0.0
    for group in by_mesh.values():
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in group])
        sq = torch.linalg.vector_norm(norms) ** 2
        total_sq += float(sq.full_tensor() if isinstance(sq, DTensor) else sq)
    total = math.sqrt(total_sq)
    if max_norm is not None and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total
