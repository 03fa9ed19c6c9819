"""``build_optimizer``: validate the parameters, pick the backend, filter when it needs it.

Backends that accept empty tensors (torch's Adam / AdamW / SGD in every implementation: for-loop,
foreach, fused) are built exactly as ``factory(groups, **kwargs)`` would build them: same class,
same code path, nothing wrapped. Backends declared as failing on empty tensors get the filtering
described in :mod:`safe_optim.filtered`.

When the caller picked no implementation (``fused`` / ``foreach`` / ``differentiable`` in the
arguments or a group) and every parameter is a floating-point tensor of one device type,
``"adamw"`` / ``"adam"`` pick one (:data:`IMPLEMENTATION`):

- on CUDA torch's fused implementation (``fused=True``: one kernel per device and dtype applies
  the whole update, where the default ``foreach`` path runs a chain of ``_foreach_*`` kernels);
- the for-loop (``foreach=False``) when ``DTensor`` and plain tensors mix (a module trained in
  full beside sharded ones): torch's fused and ``foreach`` ops refuse a list that mixes them,
  and on CUDA torch's own default (``foreach``) would too.

The CPU keeps torch's default, the for-loop. Its fused kernel rounds its vectorised body and
its scalar tail differently, so an element's update depends on where its shard starts and a
sharded run no longer equals one process (a LoRA run's grad norm moved by 1.5e-5); ``foreach``
on ``DTensor`` parameters was no faster than the for-loop (a 4-rank launch of 32 layout checks:
277 s against 285 s).

The update is the same AdamW / Adam update; torch's fused kernel skips zero-numel tensors
itself, so empty FSDP2 shards need no filter.

Input checks are local and identical on every rank (same arguments, same code), so they need no
agreement between ranks; which parameters are empty differs by rank but is not an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from safe_optim.backends import resolve_optimizer
from safe_optim.filtered import build_skipping_empty

__all__ = ["build_optimizer"]

# the implementation "adamw" / "adam" take on each device type (elsewhere: torch's default)
IMPLEMENTATION = {"cuda": "fused"}
_ADAM_NAMES = ("adamw", "adam")
_IMPLEMENTATION_KEYS = {"fused", "foreach", "differentiable"}


def build_optimizer(
    params_or_groups: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw",
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Build an optimizer that works when some parameters have empty local shards.

    Args:
        params_or_groups: parameters (tensors of any shape, plain or ``DTensor``, e.g. FSDP2
            shards whose local part may have 0 elements), or param-group dicts each with a
            non-empty ``"params"`` list and any per-group options.
        optimizer: ``"adamw"``, ``"adam"`` (torch's fused kernel on CUDA, see the module
            docstring), ``"sgd"``, ``"te_fused_adam"`` (TransformerEngine's ``FusedAdam``,
            imported only then), or a class / factory / ``functools.partial`` called as
            ``optimizer(param_groups, **kwargs)``.
        **kwargs: the backend's options (``lr``, ``weight_decay``, ...).

    For a backend declared as failing on empty tensors (``te_fused_adam``, or any declared with
    :func:`safe_optim.declare_no_empty_tensors`), parameters whose local shard is empty are left
    out of the backend's step; every rank keeps the same groups in the same order with all their
    parameters and options, so LR schedulers and ``torch.distributed.checkpoint`` behave as
    without filtering. How many were left out is logged per rank (logger ``safe_optim``).

    Raises:
        ValueError: no parameters, a group without parameters, a parameter given twice, an
            unknown optimizer name.
        TypeError: a non-tensor parameter, a malformed group, an optimizer that is neither a name
            nor callable.
        ImportError: ``"te_fused_adam"`` without TransformerEngine.
    """
    groups = _normalize(params_or_groups)
    factory, accepts_empty = resolve_optimizer(optimizer)
    kwargs = {**kwargs, **_implementation(optimizer, groups, kwargs)}
    if accepts_empty:
        return factory(groups, **kwargs)
    return build_skipping_empty(groups, factory, kwargs)


def _implementation(
    optimizer: Any, groups: list[dict[str, Any]], kwargs: dict[str, Any]
) -> dict[str, bool]:
    """The implementation argument "adamw" / "adam" get (module docstring); none when the
    caller picked one, for another optimizer, or for parameters that are not all floating-point
    tensors of one device type of :data:`IMPLEMENTATION`."""
    if not (isinstance(optimizer, str) and optimizer in _ADAM_NAMES):
        return {}
    if _IMPLEMENTATION_KEYS & (kwargs.keys() | {k for g in groups for k in g}):
        return {}
    params = [p for g in groups for p in g["params"]]
    kinds = {p.device.type for p in params}
    if len(kinds) != 1 or kinds - IMPLEMENTATION.keys():
        return {}
    if not all(p.is_floating_point() for p in params):
        return {}
    if len({_is_dtensor(p) for p in params}) > 1:
        return {"foreach": False}
    return {IMPLEMENTATION[kinds.pop()]: True}


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _normalize(params_or_groups: Any) -> list[dict[str, Any]]:
    if isinstance(params_or_groups, (torch.Tensor, dict, str)) or not isinstance(
        params_or_groups, Iterable
    ):
        raise TypeError(
            "params_or_groups must be an iterable of tensors or of param-group dicts "
            f"(e.g. model.parameters()), got {type(params_or_groups).__name__}"
        )
    items = list(params_or_groups)
    if not items:
        raise ValueError(
            "build_optimizer got an empty parameter list; expected at least one tensor or "
            "param-group dict"
        )
    if all(isinstance(item, dict) for item in items):
        groups = [_group(i, item) for i, item in enumerate(items)]
    elif any(isinstance(item, dict) for item in items):
        raise TypeError(
            "params_or_groups mixes param-group dicts with other items; give either tensors "
            f"or dicts, got {sorted({type(item).__name__ for item in items})}"
        )
    else:
        groups = [{"params": _tensors(items, "params_or_groups")}]
    seen: set[int] = set()
    for i, group in enumerate(groups):
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} appears more than once (again in "
                    f"param group {i}); every parameter must be given once"
                )
            seen.add(id(p))
    return groups


def _group(index: int, group: dict[str, Any]) -> dict[str, Any]:
    if "params" not in group:
        raise TypeError(
            f"param group {index} has no 'params' key; got keys {sorted(map(str, group))}"
        )
    params = group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, (dict, str)) or not isinstance(params, Iterable):
        raise TypeError(
            f"param group {index}: 'params' must be a tensor or an iterable of tensors, "
            f"got {type(params).__name__}"
        )
    tensors = _tensors(list(params), f"param group {index}")
    if not tensors:
        raise ValueError(
            f"param group {index} has no parameters; expected at least one tensor (drop the group "
            "or move its options to a group that has parameters)"
        )
    return {**group, "params": tensors}


def _tensors(items: list[Any], where: str) -> list[torch.Tensor]:
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise TypeError(
                f"{where}: item {i} is a {type(item).__name__}, expected a torch.Tensor parameter"
            )
    return items
