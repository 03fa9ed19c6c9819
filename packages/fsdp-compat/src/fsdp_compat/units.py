"""Which submodules become sharding units, and which parameters EP already shards.

Units: ``unit_modules`` (classes, class names or dotted ``module.Class`` paths) or, by default,
the model's ``_no_split_modules`` (the class names Hugging Face models publish for exactly this
purpose). Every submodule whose class matches is a unit; the root is never a unit (it is
sharded last, on its own). An explicit entry that matches nothing is an error (a typo would
otherwise silently leave that block unsharded); for the ``_no_split_modules`` default only an
empty overall match is an error, since those lists name classes of optional towers too.

EP parameters: a parameter that is a DTensor on a mesh containing the ``ep_dim`` dim is already
split across EP ranks. Its FSDP group must exclude the EP dim (otherwise FSDP would reduce the
gradients of DIFFERENT experts together), so the module holding it becomes a unit of its own,
sharded on the shard dims minus ``ep_dim``. A module holding both EP and ordinary parameters
directly cannot be given one FSDP group and is rejected.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ep_modules", "resolve_unit_modules"]


def _class_keys(cls: type) -> set[str]:
    return {cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"}


def _entries(model: nn.Module, unit_modules: object) -> tuple[list[type | str], bool]:
    if unit_modules is None:
        default = getattr(model, "_no_split_modules", None)
        if not default:
            raise ValueError(
                f"unit_modules not given and {type(model).__name__} has no _no_split_modules: "
                "pass unit_modules=[BlockClass, ...] (classes or class names)"
            )
        return list(default), False
    if isinstance(unit_modules, (str, type)):
        unit_modules = [unit_modules]
    if not isinstance(unit_modules, Iterable):
        raise TypeError(
            f"unit_modules must be classes or class names, got {type(unit_modules).__name__}"
        )
    entries = list(unit_modules)
    for e in entries:
        if not (isinstance(e, str) or (isinstance(e, type) and issubclass(e, nn.Module))):
            raise TypeError(f"unit_modules entries must be nn.Module classes or names, got {e!r}")
    return entries, True


def resolve_unit_modules(
    model: nn.Module, unit_modules: Sequence[type | str] | None
) -> tuple[list[nn.Module], list[type]]:
    """(unit instances, children before parents; the distinct unit classes)."""
    entries, explicit = _entries(model, unit_modules)
    named = [(n, m) for n, m in model.named_modules() if m is not model]
    matched: dict[int, type] = {}
    used: set[int] = set()
    for i, entry in enumerate(entries):
        for _, module in named:
            cls = type(module)
            hit = cls is entry if isinstance(entry, type) else entry in _class_keys(cls)
            if hit:
                matched[id(module)] = cls
                used.add(i)
    unused = [entries[i] for i in range(len(entries)) if i not in used]
    if not matched or (explicit and unused):
        present = sorted({type(m).__name__ for _, m in named})
        source = "unit_modules" if explicit else f"{type(model).__name__}._no_split_modules"
        raise ValueError(
            f"{source} entries {[getattr(e, '__name__', e) for e in unused]} match no submodule "
            f"of {type(model).__name__}; its submodule classes are {present}"
        )
    units = [m for _, m in reversed(named) if id(m) in matched]
    classes = list(dict.fromkeys(matched.values()))
    return units, classes


def _is_ep_param(param: nn.Parameter, ep_dim: str) -> bool:
    return isinstance(param, DTensor) and ep_dim in (param.device_mesh.mesh_dim_names or ())


def ep_modules(model: nn.Module, ep_dim: str) -> list[nn.Module]:
    """Modules holding EP-sharded parameters directly, children before parents."""
    found = []
    for name, module in reversed(list(model.named_modules())):
        direct = list(module.named_parameters(recurse=False))
        ep = [n for n, p in direct if _is_ep_param(p, ep_dim)]
        if not ep:
            continue
        other = [n for n, p in direct if not _is_ep_param(p, ep_dim)]
        if other or module is model:
            where = name or "the root module"
            raise ValueError(
                f"{where} holds EP-sharded parameters {ep} (DTensors on a mesh with dim {ep_dim!r})"
                + (f" next to ordinary parameters {other}" if other else "")
                + ": put the experts in a submodule of their own so they get an FSDP group "
                "without the EP dim"
            )
        found.append(module)
    return found
