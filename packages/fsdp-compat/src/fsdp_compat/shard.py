"""``shard_model``: one entry point over FSDP2 and megatron-fsdp.

Argument handling common to both backends lives here: the shard dims are flattened ONCE into a
mesh object that the backend then uses (see :mod:`fsdp_compat.mesh` for why a name lookup is
not enough), unit modules are resolved (:mod:`fsdp_compat.units`), and backend-neutral options
are taken out of ``backend_options`` before the rest goes to the backend:

- ``ep_dim`` (default ``"ep"``): parameters that are DTensors on a mesh with this dim are
  EP-sharded; under FSDP2 their modules are sharded on the shard dims without it.
- ``replicate_dims`` (default ``()``): HSDP; parameters are replicated over these dims and
  sharded over ``shard_dims``.
- ``expert_mesh`` (default ``None``): the FSDP mesh of the EP modules, given explicitly (1-D,
  or 2-D ``(replicate, shard)`` for HSDP) when the experts live on a mesh of their own (an
  expert mesh whose EP dim borrows ranks from the data × context ranks: it is not a dim of
  ``mesh``); it must share a root mesh with the experts' DTensors, as FSDP2 requires.
- ``grad_reduction`` (default ``"mean"``): ``"sum"`` makes every FSDP2 gradient reduction a
  SUM (``set_gradient_divide_factor(1.0)`` with ``set_force_sum_reduction_for_comms(True)``, on
  every unit, so no backend falls back to a pre- or post-division): for losses that are each
  rank's share of the global loss. megatron-fsdp: ``"sum"`` is its
  ``calculate_per_token_loss=True`` (no gradient scaling, so its reduce-scatters and the HSDP
  outer reduction are plain SUMs).
- ``tp_dim`` / ``report_nan``: megatron-fsdp only (FSDP2 reads TP from the DTensors and has no
  NaN report); given to FSDP2 they are an error rather than silently ignored.

Every check here depends only on arguments and module structure, which are the same on every
rank, so all ranks raise together and none is left waiting in a collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_compat.mesh import flatten_mesh
from fsdp_compat.precision import MixedPrecision
from fsdp_compat.units import ep_modules, resolve_unit_modules

__all__ = ["BACKENDS", "GRAD_REDUCTIONS", "shard_model", "shard_modules"]

BACKENDS = ("fsdp2", "megatron-fsdp")
GRAD_REDUCTIONS = ("mean", "sum")


def _dims(name: str, value: object, allow_empty: bool) -> tuple[str, ...]:
    dims = (value,) if isinstance(value, str) else value
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, str) for d in dims):
        raise TypeError(f"{name} must be a mesh dim name or a tuple of names, got {value!r}")
    if not dims and not allow_empty:
        raise ValueError(f"{name} must name at least one mesh dim, got {value!r}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"{name} names a dim twice: {tuple(dims)}")
    return tuple(dims)


def _hsdp_mesh(
    mesh: DeviceMesh, replicate: tuple[str, ...], shard: tuple[str, ...]
) -> DeviceMesh | None:
    """A 2-D (replicate, shard) mesh for HSDP, or the 1-D shard mesh; ``None`` if no shard dim."""
    if not shard:
        return None
    shard_mesh = flatten_mesh(mesh, shard)
    if not replicate:
        return shard_mesh
    return DeviceMesh._concatenate([flatten_mesh(mesh, replicate), shard_mesh])


def _tp_dim_from_params(model: nn.Module, ep_dim: str) -> str | None:
    names = {
        name
        for p in model.parameters()
        if isinstance(p, DTensor) and ep_dim not in (p.device_mesh.mesh_dim_names or ())
        for name in p.device_mesh.mesh_dim_names or ()
    }
    if len(names) > 1:
        raise ValueError(f"TP parameters live on several mesh dims {sorted(names)}; pass tp_dim=")
    return next(iter(names), None)


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    backend: str = "fsdp2",
    shard_dims: Sequence[str] = ("dp",),
    unit_modules: Sequence[type | str] | None = None,
    reshard_after_forward: bool | int | None = None,
    mixed_precision: MixedPrecision | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    **backend_options: Any,
) -> nn.Module:
    """Shard ``model`` over the ``shard_dims`` of ``mesh`` with FSDP2 or megatron-fsdp.

    ``shard_dims``: dims of ``mesh`` (its root) whose product is the shard group; several are
    flattened once (e.g. ("dp", "cp") → "dp_cp"). ``unit_modules``: classes / class names of the
    blocks sharded as units (default: ``model._no_split_modules``). ``reshard_after_forward``
    and other optional arguments reach the backend only when set. ``optimizer``: built on the
    unsharded parameters, no state yet; it is re-pointed at the sharded ones.
    Returns the sharded model (FSDP2: ``model`` itself; megatron-fsdp: its wrapper).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision must be fsdp_compat.MixedPrecision, got {type(mixed_precision).__name__}"
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise TypeError(
            f"reshard_after_forward must be a bool, an int or None, got {reshard_after_forward!r}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    options = dict(backend_options)
    shard = _dims("shard_dims", shard_dims, allow_empty=False)
    replicate = _dims("replicate_dims", options.pop("replicate_dims", ()), allow_empty=True)
    if set(shard) & set(replicate):
        raise ValueError(f"shard_dims {shard} and replicate_dims {replicate} overlap")
    ep_dim = options.pop("ep_dim", "ep")
    if not isinstance(ep_dim, str):
        raise TypeError(f"ep_dim must be a mesh dim name, got {ep_dim!r}")
    expert_mesh = options.pop("expert_mesh", None)
    if expert_mesh is not None and (
        not isinstance(expert_mesh, DeviceMesh) or expert_mesh.ndim > 2
    ):
        raise TypeError(f"expert_mesh must be a 1-D or 2-D DeviceMesh, got {expert_mesh!r}")
    reduction = options.pop("grad_reduction", "mean")
    if reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {reduction!r}")
    request = _Request(model, mesh, shard, replicate, ep_dim, reshard_after_forward,
                       mixed_precision, optimizer, options, reduction == "sum")  # fmt: skip
    units, unit_classes = resolve_unit_modules(model, unit_modules)
    if backend == "fsdp2":
        return _fsdp2(request, units, expert_mesh)
    if expert_mesh is not None:
        raise ValueError(
            "expert_mesh is an FSDP2 option: megatron-fsdp derives its expert groups itself"
        )
    return _megatron(request, unit_classes)


@dataclasses.dataclass
class _Request:
    """What :func:`shard_model` was asked, checked: what both backends read (``shard`` /
    ``replicate``: the dims; ``sum_reduction``: ``grad_reduction == "sum"``)."""

    model: nn.Module
    mesh: DeviceMesh
    shard: tuple[str, ...]
    replicate: tuple[str, ...]
    ep_dim: str
    reshard: bool | int | None
    precision: MixedPrecision | None
    optimizer: torch.optim.Optimizer | None
    options: dict[str, Any]
    sum_reduction: bool


def _fsdp2(r: _Request, units: list[nn.Module], expert_mesh: DeviceMesh | None) -> nn.Module:
    from fsdp_compat.fsdp2 import shard_fsdp2

    megatron_only = sorted({"tp_dim", "report_nan"} & set(r.options))
    if megatron_only:
        raise ValueError(
            f"backend_options {megatron_only} are megatron-fsdp options; FSDP2 reads TP from the "
            "DTensor parameters and has no NaN report"
        )
    ep_units = ep_modules(r.model, r.ep_dim)
    ep_mesh = expert_mesh
    if ep_units and ep_mesh is None:
        without_ep = [tuple(d for d in dims if d != r.ep_dim) for dims in (r.replicate, r.shard)]
        ep_mesh = _hsdp_mesh(r.mesh, *without_ep)
    return shard_fsdp2(
        r.model,
        units=units,
        ep_units=ep_units,
        shard_mesh=_hsdp_mesh(r.mesh, r.replicate, r.shard),
        ep_mesh=ep_mesh,
        reshard_after_forward=r.reshard,
        mixed_precision=r.precision,
        optimizer=r.optimizer,
        names=_optimizer_names(r.model, r.optimizer),
        options=r.options,
        sum_reduction=r.sum_reduction,
    )


def _megatron(r: _Request, unit_classes) -> nn.Module:
    from fsdp_compat.megatron import build_megatron_call, check_megatron_tp_params
    from fsdp_compat.megatron_optim import attach_optimizer

    model, mesh, shard, replicate, options = r.model, r.mesh, r.shard, r.replicate, r.options
    ep_dim, optimizer = r.ep_dim, r.optimizer

    check_megatron_tp_params(model)  # before any process group is created
    tp_dim = options.pop("tp_dim", None) or _megatron_tp_dim(model, mesh, ep_dim)
    report_nan = options.pop("report_nan", None)
    names = _optimizer_names(model, optimizer)
    shard_mesh = flatten_mesh(mesh, shard)
    replicate_mesh = flatten_mesh(mesh, replicate) if replicate else None
    hybrid_mesh = flatten_mesh(mesh, replicate + shard) if replicate else None
    if _megatron_experts_without_ep(model, ep_dim) and "expt_device_mesh" not in options:
        # megatron-fsdp takes every parameter named "*.experts.*" for an expert parameter and
        # shards it over its expert mesh; not EP-split, they shard like the dense ones
        options["expt_device_mesh"] = mesh._get_root_mesh()
        if hybrid_mesh is not None:
            options.setdefault("hybrid_fsdp_expt_group", hybrid_mesh.get_group())
    fn, kwargs = build_megatron_call(
        model,
        mesh,
        shard_mesh=shard_mesh,
        replicate_mesh=replicate_mesh,
        hybrid_mesh=hybrid_mesh,
        tp_dim=tp_dim,
        unit_classes=unit_classes,
        reshard_after_forward=r.reshard,
        mixed_precision=r.precision,
        report_nan=report_nan,
        sum_reduction=r.sum_reduction,
        options=options,
    )
    wrapper = fn(**kwargs)
    # every backward completes the step's reductions (HSDP's replica all-reduce included) until
    # fsdp_compat.accumulating says otherwise
    wrapper.is_last_microbatch = True
    if optimizer is not None:
        attach_optimizer(wrapper, optimizer, names)
    return wrapper


def _megatron_experts_without_ep(model: nn.Module, ep_dim: str) -> bool:
    """Whether ``model`` has parameters megatron-fsdp calls expert parameters (``.experts.`` in
    the name) and none of them is EP-sharded (a DTensor on a mesh with ``ep_dim``)."""
    experts = [p for n, p in model.named_parameters() if ".experts." in f".{n}"]
    return bool(experts) and not any(
        isinstance(p, DTensor) and ep_dim in (p.device_mesh.mesh_dim_names or ()) for p in experts
    )


def _megatron_tp_dim(model: nn.Module, mesh: DeviceMesh, ep_dim: str) -> str:
    """The TP dim megatron-fsdp is given: the TP DTensors' dim, else the mesh's ``"tp"`` dim of
    size 1 (megatron-fsdp needs one even without TP); anything else is the caller's to name."""
    tp_dim = _tp_dim_from_params(model, ep_dim)
    if tp_dim is not None:
        return tp_dim
    root = mesh._get_root_mesh()
    names = root.mesh_dim_names or ()
    if "tp" in names and root.size(names.index("tp")) == 1:
        return "tp"
    raise ValueError(
        "backend='megatron-fsdp' needs a TP dim on the mesh even without tensor parallelism "
        "(megatron-fsdp looks the TP mesh up for every parameter it shards): give the mesh a "
        f"dim named 'tp' of size 1 or pass tp_dim=<name>; the mesh has dims {names}"
    )


def _optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    """The names of the optimizer's parameters in ``model`` (``None`` without an optimizer);
    ``ValueError`` if it already has state or holds a tensor that is not the model's."""
    if optimizer is None:
        return None
    if optimizer.state:
        raise ValueError(
            "the optimizer already has state; build it (or shard the model) before the first step"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if stray:
        raise ValueError(f"the optimizer holds {len(stray)} parameters that are not the model's")
    return names


def shard_modules(
    modules: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    shard_dims: Sequence[str] = ("dp",),
    mixed_precision: MixedPrecision | None = None,
    grad_reduction: str = "mean",
) -> None:
    """FSDP2 on ``modules`` only, each its own unit and root, the rest of their model left as
    it is (in place): for a few modules that need what FSDP gives — a model otherwise unsharded
    whose trained modules must be cast for the compute (``mixed_precision``), as one process
    training adapters and a few modules in full does. ``shard_dims`` and ``grad_reduction`` as
    for :func:`shard_model`."""
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {grad_reduction!r}")
    shard = _dims("shard_dims", shard_dims, allow_empty=False)
    for module in modules:
        request = _Request(module, mesh, shard, (), "ep", None, mixed_precision, None, {},
                           grad_reduction == "sum")  # fmt: skip
        _fsdp2(request, [], None)
