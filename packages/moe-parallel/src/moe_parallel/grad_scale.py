"""Undo the TP replication of expert gradients.

When an EP group spans tensor-parallel ranks, every TP rank feeds the SAME tokens into the
dispatch, so every expert sees each token ``tp`` times and its gradient is the sum of ``tp``
identical contributions. Router, shared expert and other parameters are computed on the home
rank and are not affected; so only the routed expert weights are divided by ``tp``. Call it after
``backward`` and before any gradient all-reduce or clipping.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moe_parallel.moe import Experts

__all__ = ["scale_expert_grads"]


@torch.no_grad()
def scale_expert_grads(model: nn.Module, mesh: DeviceMesh) -> int:
    """Divide the gradients of every routed expert weight by ``mesh.size()`` (the TP degree).

    Args:
        model: holds :class:`~moe_parallel.moe.Experts` modules after backward.
        mesh: the 1-D TP mesh whose ranks fed identical tokens into expert parallelism.

    Returns:
        The number of gradients scaled.

    Raises:
        TypeError: ``mesh`` is not a 1-D ``DeviceMesh``.
        ValueError: an expert weight has no gradient (backward did not reach it).
    """
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise TypeError(f"mesh must be the 1-D TP DeviceMesh, got {mesh!r}")
    factor = mesh.size()
    scaled = 0
    for name, module in model.named_modules():
        if not isinstance(module, Experts):
            continue
        for pname, param in module.named_parameters():
            if param.grad is None:
                raise ValueError(
                    f"{name}.{pname} has no gradient: call scale_expert_grads after backward"
                )
            param.grad.div_(factor)
            scaled += 1
    return scaled
