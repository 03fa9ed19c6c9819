"""Fail-closed tensor-parallel plans.

A plan is data: ``{module path pattern: ParallelStyle}``. Patterns are ``fnmatch`` patterns
(``*`` also crosses dots) expanded against ``model.named_modules()``. A plan is rejected when a
pattern matches nothing (a typo would otherwise silently leave a layer unsharded) or when a
matched module is, contains or lies inside a routed-experts module or a router. Routed experts
are sharded by expert parallelism, and a router sharded by TP would split the softmax over
experts across ranks: both give wrong results without any error. MoE blocks are recognised by
structure (a module with both a ``gate`` and an ``experts`` child), so transformers' block and
:class:`moe_parallel.MoE` are covered alike. Nothing is sharded that the plan does not name.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

__all__ = ["apply_tensor_parallel", "validate_tp_plan"]


def _protected_paths(model: nn.Module) -> list[str]:
    paths = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if "gate" in children and "experts" in children:
            prefix = f"{name}." if name else ""
            paths += [f"{prefix}gate", f"{prefix}experts"]
    return paths


def _overlaps(path: str, protected: str) -> bool:
    return path == protected or protected.startswith(f"{path}.") or path.startswith(f"{protected}.")


def validate_tp_plan(
    model: nn.Module, plan: Mapping[str, ParallelStyle]
) -> dict[str, ParallelStyle]:
    """Expand ``plan``'s patterns to concrete module paths and check them.

    Returns:
        ``{module path: style}`` in ``named_modules`` order.

    Raises:
        TypeError: ``plan`` is not a mapping of str patterns to ``ParallelStyle``.
        ValueError: a pattern matches no module, or a matched path reaches routed experts or a
            router (the message names the pattern and the offending path), or two patterns
            match the same module.
    """
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            f"plan must be a non-empty mapping of pattern -> ParallelStyle, got {plan!r}"
        )
    names = [n for n, _ in model.named_modules() if n]
    protected = _protected_paths(model)
    expanded: dict[str, ParallelStyle] = {}
    origin: dict[str, str] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not isinstance(style, ParallelStyle):
            raise TypeError(
                f"plan entries must be str -> ParallelStyle, got {pattern!r} -> {type(style).__name__}"
            )
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ValueError(
                f"TP plan pattern {pattern!r} matches no module of {type(model).__name__}"
            )
        for path in matched:
            hit = next((p for p in protected if _overlaps(path, p)), None)
            if hit is not None:
                raise ValueError(
                    f"TP plan pattern {pattern!r} reaches {path!r}, which overlaps the routed "
                    f"experts / router {hit!r}: routed experts are sharded by expert parallelism "
                    "and the router must stay replicated"
                )
            if path in origin:
                raise ValueError(
                    f"module {path!r} matched by both {origin[path]!r} and {pattern!r}"
                )
            origin[path] = pattern
            expanded[path] = style
    return {n: expanded[n] for n in names if n in expanded}


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]
) -> nn.Module:
    """Validate ``plan`` (:func:`validate_tp_plan`) and apply it on the 1-D ``tp_mesh``; in place."""
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise TypeError(f"tp_mesh must be a 1-D DeviceMesh, got {tp_mesh!r}")
    return parallelize_module(model, tp_mesh, validate_tp_plan(model, plan))
