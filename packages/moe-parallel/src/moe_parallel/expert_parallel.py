"""Expert parallelism: shard every MoE's routed experts over an EP mesh.

Each :class:`~moe_parallel.moe.Experts` module's ``gate_up_proj`` / ``down_proj`` — and its
low-rank adapters (:mod:`moe_parallel.lora`), stacked by expert the same way — become DTensors
placed ``Shard(0)`` on the 1-D EP mesh (rank r holds experts r*L .. r*L+L-1) and the
module's ``ep_group`` is set, so its forward exchanges rows with
:func:`~moe_parallel.dispatch.all_to_all_expert_compute`. The router, the routing weights and
the shared expert stay on each token's home rank (see :mod:`moe_parallel.moe`), so their
gradients are local, like any data-parallel replica's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from moe_parallel.moe import Experts

__all__ = ["apply_expert_parallel"]


def _scatter(full: torch.Tensor, ep_mesh: DeviceMesh) -> DTensor:
    """``full`` as a DTensor ``Shard(0)`` on ``ep_mesh``, scattered from rank 0; a float8
    tensor travels as its bytes (gloo has no float8 type)."""
    if full.dtype.itemsize != 1 or not full.dtype.is_floating_point:
        return distribute_tensor(full, ep_mesh, [Shard(0)])
    as_bytes = distribute_tensor(full.view(torch.uint8), ep_mesh, [Shard(0)])
    local = as_bytes.to_local().view(full.dtype)
    return DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape,
                              stride=full.stride())  # fmt: skip


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh, *, tp_mesh: DeviceMesh | None = None
) -> nn.Module:
    """Shard the routed experts of every MoE in ``model`` over the 1-D ``ep_mesh``; in place.

    ``tp_mesh``: the 1-D TP mesh when the EP group spans tensor-parallel ranks that hold
    identical tokens. Each TP rank then dispatches only its 1/tp block of tokens and the expert
    outputs are gathered over TP (:mod:`moe_parallel.token_split`), so every token reaches its
    experts once and expert gradients are exact (without it they come out tp times too large).
    Every rank of ``tp_mesh`` must belong to ``ep_mesh``.

    Rank 0's full expert weights are scattered (``distribute_tensor``; FP8 weights as their
    bytes, which every backend can send); rank r keeps experts r*L .. r*L+L-1. Returns
    ``model``.

    Raises:
        TypeError: ``ep_mesh`` (or ``tp_mesh``) is not a 1-D ``DeviceMesh``.
        ValueError: the model has no MoE experts, or the EP size does not divide an MoE's
            number of experts, or the experts were already sharded, or ``tp_mesh`` has ranks
            outside ``ep_mesh``.
    """
    if not isinstance(ep_mesh, DeviceMesh) or ep_mesh.ndim != 1:
        raise TypeError(f"ep_mesh must be a 1-D DeviceMesh, got {ep_mesh!r}")
    if tp_mesh is not None:
        if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
            raise TypeError(f"tp_mesh must be a 1-D DeviceMesh or None, got {tp_mesh!r}")
        outside = set(tp_mesh.mesh.flatten().tolist()) - set(ep_mesh.mesh.flatten().tolist())
        if outside:
            raise ValueError(
                f"tp_mesh ranks {sorted(outside)} are not in ep_mesh {ep_mesh.mesh.flatten().tolist()}: "
                "splitting tokens over TP is exact only when the EP group spans the TP ranks"
            )
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, Experts)]
    if not experts:
        raise ValueError(f"{type(model).__name__} has no moe_parallel Experts module to shard")
    ep_size = ep_mesh.size()
    for name, module in experts:
        if module.ep_group is not None:
            raise ValueError(f"{name or 'model'}: experts are already expert-parallel")
        if module.num_experts % ep_size:
            raise ValueError(
                f"{name or 'model'}: EP size {ep_size} must divide num_experts "
                f"{module.num_experts} (each rank owns the same number of experts)"
            )
    for _, module in experts:
        # every parameter is stacked by expert: the weights and their adapters
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = _scatter(param.data, ep_mesh)
            setattr(module, pname, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.ep_group = ep_mesh.get_group()
        if tp_mesh is not None and tp_mesh.size() > 1:
            module.tp_group = tp_mesh.get_group()
    return model
