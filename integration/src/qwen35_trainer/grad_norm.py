"""Gradient-norm clipping over parameters that live on different device meshes.

Under EP the dense parameters are DTensors on the flattened ``dp x ep`` mesh and the experts on
the 2-D ``(dp, ep)`` mesh; ``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms and
cannot mix meshes. Here the squared norms are summed per mesh (DTensor arithmetic, so shards
and replicas are counted once), each mesh's sum is materialised with ``full_tensor`` (identical
on every rank), and the total scales every gradient with the same coefficient, as one process
would.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm"]


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients of ``params`` to total L2 norm ``max_norm``; returns the norm before."""
    params = [p for p in params if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else p.grad.device
        by_mesh.setdefault(key, []).append(p.grad)
    total_sq = 0.0
    for grads in by_mesh.values():
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
        sq = torch.linalg.vector_norm(norms) ** 2
        total_sq += float(sq.full_tensor() if isinstance(sq, DTensor) else sq)
    total = math.sqrt(total_sq)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return total
