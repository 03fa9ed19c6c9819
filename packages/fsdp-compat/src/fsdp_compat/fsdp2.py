"""The FSDP2 path: ``fully_shard`` per unit, then the root.

Correctness argument:

- Every unit and the root get the SAME mesh object (the flattened shard dims, built once), so
  the reduce-scatter group of every parameter is the full DP×CP group; nothing is looked up by
  name afterwards.
- Units are sharded children before parents; FSDP2 skips parameters an inner ``fully_shard``
  already manages, so each parameter belongs to exactly one FSDP group.
- EP modules (see :mod:`fsdp_compat.units`) are sharded first on the shard dims WITHOUT the EP
  dim; their parameters are DTensors on the EP mesh and FSDP2 composes the two meshes
  (``_concatenate``), which requires the meshes to be disjoint, as they are by construction.
- Optional ``fully_shard`` arguments are passed only when set: some torch builds reject
  ``reshard_after_forward=None``, and ``None`` would also hide the backend's own default.
- ``sum_reduction``: every FSDP module (units, EP units, root) reduces with a plain SUM: the
  divide factor is 1 and the SUM is forced for the communication itself, so no backend
  (gloo lacks ``PREMUL_SUM`` / ``AVG``) substitutes a division before or after it. Each
  parameter belongs to exactly one FSDP module, so setting it on all of them covers every
  gradient, HSDP's all-reduce over the replicate dim included.
- ``fully_shard`` replaces each parameter object; an optimizer built before sharding is
  re-pointed at the new parameters by name (it must not hold state yet).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from fsdp_compat.precision import MixedPrecision

__all__ = ["fsdp2_kwargs", "shard_fsdp2"]

_RESERVED = {"module", "mesh", "reshard_after_forward", "mp_policy"}


def fsdp2_kwargs(
    mesh: DeviceMesh,
    reshard_after_forward: bool | int | None,
    mixed_precision: MixedPrecision | None,
    options: dict[str, Any],
) -> dict[str, Any]:
    """The keyword arguments given to every ``fully_shard`` call (optional ones only when set)."""
    accepted = set(inspect.signature(fully_shard).parameters) - _RESERVED
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(
            f"backend_options {unknown} are not fully_shard arguments in torch {torch.__version__}; "
            f"accepted: {sorted(accepted)}"
        )
    kwargs: dict[str, Any] = {"mesh": mesh}
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision.to_fsdp2()
    kwargs.update(options)
    return kwargs


def _repoint_optimizer(
    optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module
) -> None:
    new = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [new[names[id(p)]] for p in group["params"]]


def shard_fsdp2(
    model: nn.Module,
    *,
    units: Sequence[nn.Module],
    ep_units: Sequence[nn.Module],
    shard_mesh: DeviceMesh,
    ep_mesh: DeviceMesh | None,
    reshard_after_forward: bool | int | None,
    mixed_precision: MixedPrecision | None,
    optimizer: torch.optim.Optimizer | None,
    names: dict[int, str] | None,
    options: dict[str, Any],
    sum_reduction: bool = False,
) -> nn.Module:
    """Shard ``ep_units`` on ``ep_mesh``, then ``units`` and the root on ``shard_mesh``;
    ``optimizer`` (its parameters' names: ``names``) is re-pointed at the sharded parameters."""
    kwargs = fsdp2_kwargs(shard_mesh, reshard_after_forward, mixed_precision, options)
    if ep_units:
        if ep_mesh is None:
            raise ValueError("EP parameters found but no mesh is left once the EP dim is removed")
        ep_kwargs = {**kwargs, "mesh": ep_mesh}
        for module in ep_units:
            fully_shard(module, **ep_kwargs)
    done = {id(m) for m in ep_units}
    for module in units:
        if id(module) not in done:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    if sum_reduction:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    if optimizer is not None:
        _repoint_optimizer(optimizer, names, model)
    return model
