"""The megatron-fsdp path: one adapter over the installed release's real signature.

megatron-fsdp's entry point ``fully_shard_model`` changes keyword names between releases (``check_for_nan_in_grad`` became
``report_nan_in_param_grad``; 0.5 added ``fsdp_group_ag`` / ``expt_fsdp_group_ag``; 0.6 added
``maxpool_double_buffer``). The adapter builds its call AS DATA (:func:`build_megatron_call`
returns the function and the keyword dict) from ``inspect.signature`` of the installed function:
every name it needs must be there, otherwise it fails closed naming the version and the missing
names. It never guesses an argument from a default. Its ``fully_shard(module, optimizer)`` is
never called: it regroups the optimizer's parameters and steps it once on zero gradients
(:mod:`fsdp_compat.megatron_optim` says why that trains differently, and wires the optimizer).

Translation (ours → megatron-fsdp):

- shard dims → ``device_mesh`` (the root mesh) + ``dp_shard_dim`` (the flattened dim's name;
  megatron-fsdp resolves it through the root's flattened meshes, and the adapter checks that the
  name resolves to the very mesh object it flattened);
- replicate dims (HSDP) → ``dp_outer_dim`` + ``hybrid_fsdp_group`` (group of replicate×shard);
- ``tp_dim`` → ``tp_dim``: required, even without tensor parallelism (a dim of size 1), because
  megatron-fsdp looks the TP mesh up for every parameter it shards;
- unit modules → ``fsdp_unit_modules`` (classes);
- ``reshard_after_forward`` True/False → ``zero_dp_strategy`` "optim_grads_params" (ZeRO-3:
  parameters freed after forward) / "optim_grads" (ZeRO-2: parameters kept); omitted when unset;
- :class:`MixedPrecision` → ``mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype,
  main_grads_dtype, grad_comm_dtype)``; ``report_nan`` → the release's NaN-report flag;
- ``grad_reduction="sum"`` → ``calculate_per_token_loss=True``: megatron-fsdp then gives its
  gradient buffers no scaling factor, and an unscaled bucket is reduced with ``ReduceOp.SUM``
  (the HSDP outer reduction sums unless ``average_in_collective``), so every reduction is a
  plain sum, as under FSDP2's ``"sum"``.

TP DTensors: the published wheels build gradient/parameter DTensors with
``local.view(-1, *param.shape[1:])`` where ``param`` is the TP DTensor, i.e. its GLOBAL trailing
shape. For a parameter sharded on any dim ≥ 1 (rowwise TP) that view is wrong. The adapter
detects the bug from the installed release (known-bad versions, or the pattern in the source of
``make_fsdp_dtensor``) and raises before any collective; it never runs a build it knows is wrong.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_compat.precision import MixedPrecision

__all__ = [
    "BackendSignatureError",
    "build_megatron_call",
    "check_megatron_tp_params",
    "megatron_tp_shape_bug",
]

# Last release checked to carry the local-vs-global trailing-shape bug.
_LAST_KNOWN_BAD = (0, 6, 1)
_BUG_PATTERN = re.compile(r"orig_param\.shape\[1:\]")
_NAN_FLAGS = ("report_nan_in_param_grad", "check_for_nan_in_grad")
_OURS = {
    "module", "device_mesh", "dp_shard_dim", "dp_outer_dim", "hybrid_fsdp_group",
    "tp_dim", "fsdp_unit_modules", "zero_dp_strategy", "mixed_precision_policy", *_NAN_FLAGS,
    "calculate_per_token_loss",
}  # fmt: skip


class BackendSignatureError(TypeError):
    """The installed backend's entry point does not have the arguments this adapter needs."""


def _megatron():
    try:
        return importlib.import_module("megatron_fsdp")
    except ImportError as exc:
        raise ImportError(
            "backend='megatron-fsdp' needs the megatron-fsdp package "
            "(pip install 'fsdp-compat[megatron]'); it could not be imported: " + str(exc)
        ) from exc


def _version() -> str:
    try:
        return importlib.metadata.version("megatron-fsdp")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(_megatron(), "__version__", "unknown"))


def _version_tuple(version: str) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(x) for x in m.groups()) if m else None


def megatron_tp_shape_bug() -> str | None:
    """Why the installed megatron-fsdp mis-shapes TP DTensor shards, or ``None`` if it does not."""
    version = _version()
    parsed = _version_tuple(version)
    if parsed is not None and parsed <= _LAST_KNOWN_BAD:
        return f"megatron-fsdp {version} is a known-bad release (<= 0.6.1)"
    buffer = importlib.import_module("megatron_fsdp.param_and_grad_buffer")
    try:
        source = inspect.getsource(buffer.make_fsdp_dtensor)
    except (OSError, TypeError, AttributeError):
        return f"megatron-fsdp {version}: make_fsdp_dtensor source unavailable, cannot rule it out"
    if _BUG_PATTERN.search(source):
        return f"megatron-fsdp {version}: make_fsdp_dtensor views shards with orig_param.shape[1:]"
    return None


def check_megatron_tp_params(model: nn.Module) -> None:
    """Raise ``ValueError`` if a parameter is a DTensor sharded on a dim >= 1 and the installed
    release has the trailing-shape bug. Placements are the same on every rank (they come from
    the parallel plan), so every rank raises together, before any collective."""
    bad = {
        name: tuple(p.placements)
        for name, p in model.named_parameters()
        if isinstance(p, DTensor)
        and any(isinstance(pl, Shard) and pl.dim >= 1 for pl in p.placements)
    }
    if not bad:
        return
    reason = megatron_tp_shape_bug()
    if reason is not None:
        raise ValueError(
            f"{reason}: it views each rank-local shard with the DTensor's GLOBAL trailing shape, "
            f"which is wrong for parameters sharded on a dim >= 1 (rowwise TP): {bad}. "
            "Use backend='fsdp2', or shard those weights on dim 0 only (colwise TP)."
        )


def _entry() -> Callable[..., Any]:
    fn = getattr(_megatron(), "fully_shard_model", None)
    if fn is None:
        raise BackendSignatureError(
            f"megatron-fsdp {_version()} has no fully_shard_model; need 0.5.x or 0.6.x"
        )
    return fn


def _require(fn: Callable[..., Any], names: Sequence[str], what: str) -> None:
    params = inspect.signature(fn).parameters
    missing = [n for n in names if n not in params]
    if missing:
        raise BackendSignatureError(
            f"megatron-fsdp {_version()}: {getattr(fn, '__qualname__', fn)} has no {missing} "
            f"(needed for {what}); this adapter supports the 0.5.x/0.6.x signatures"
        )


def build_megatron_call(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    shard_mesh: DeviceMesh,
    replicate_mesh: DeviceMesh | None = None,
    hybrid_mesh: DeviceMesh | None = None,
    tp_dim: str,
    unit_classes: Sequence[type],
    reshard_after_forward: bool | None = None,
    mixed_precision: MixedPrecision | None = None,
    report_nan: bool | None = None,
    sum_reduction: bool = False,
    options: dict[str, Any] | None = None,
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """(megatron-fsdp entry point, the keyword arguments to call it with).

    ``shard_mesh`` / ``replicate_mesh`` / ``hybrid_mesh``: 1-D meshes (flattened or not) of the
    shard dims, the replicate dims and both together (HSDP); ``mesh`` is any mesh of their root.
    """
    options = dict(options or {})
    fn = _entry()
    _require(
        fn, ["module", "device_mesh", "dp_shard_dim", "tp_dim", "fsdp_unit_modules"], "sharding"
    )
    clash = sorted(set(options) & _OURS)
    if clash:
        raise ValueError(
            f"backend_options {clash} are set by shard_model itself; use its arguments"
        )
    _require(fn, sorted(options), "backend_options")
    from fsdp_compat.mesh import get_mesh_dim

    root = mesh._get_root_mesh()
    kwargs: dict[str, Any] = {"module": model}
    (shard_name,) = shard_mesh.mesh_dim_names
    # megatron-fsdp resolves the NAME on the root; it must give back the mesh we built.
    if get_mesh_dim(root, shard_name) != shard_mesh:
        raise ValueError(f"shard dim {shard_name!r} does not resolve to {shard_mesh} on {root}")
    kwargs.update(device_mesh=root, dp_shard_dim=shard_name, fsdp_unit_modules=list(unit_classes))
    if replicate_mesh is not None:
        _require(fn, ["dp_outer_dim", "hybrid_fsdp_group"], "HSDP (replicate dims)")
        kwargs["dp_outer_dim"] = replicate_mesh.mesh_dim_names[0]
        kwargs["hybrid_fsdp_group"] = hybrid_mesh.get_group()
    get_mesh_dim(root, tp_dim)
    kwargs["tp_dim"] = tp_dim
    if reshard_after_forward is not None:
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                f"megatron-fsdp takes reshard_after_forward as a bool, got {reshard_after_forward!r}"
            )
        _require(fn, ["zero_dp_strategy"], "reshard_after_forward")
        kwargs["zero_dp_strategy"] = (
            "optim_grads_params" if reshard_after_forward else "optim_grads"
        )
    if mixed_precision is not None:
        _require(fn, ["mixed_precision_policy"], "mixed precision")
        policy_cls = _megatron().MixedPrecisionPolicy
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        fields = mixed_precision.megatron_fields(dtypes)
        _require(policy_cls, sorted(fields), "MixedPrecisionPolicy")
        kwargs["mixed_precision_policy"] = policy_cls(**fields)
    if report_nan is not None:
        params = inspect.signature(fn).parameters
        flag = next((f for f in _NAN_FLAGS if f in params), None)
        if flag is None:
            _require(fn, [_NAN_FLAGS[0]], "report_nan")
        kwargs[flag] = bool(report_nan)
    if sum_reduction:
        _require(fn, ["calculate_per_token_loss"], "grad_reduction='sum'")
        kwargs["calculate_per_token_loss"] = True
    kwargs.update(options)
    return fn, kwargs
