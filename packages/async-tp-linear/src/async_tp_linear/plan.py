"""Swap the ``nn.Linear`` modules a ``parallelize_module`` plan shards for :class:`TPLinear`.

The swap reuses the parameter objects (``TPLinear.from_linear``), so values, dtype, device,
``requires_grad`` and any optimizer references are unchanged, and ``TPLinear.forward`` computes the
same function as ``nn.Linear.forward`` (see ``linear.py``): the model's outputs and gradients do
not change, only the shape of the compiled graph.

Plan keys are resolved the way ``parallelize_module`` resolves them: the key is split on ``.`` and
each part is an ``fnmatch`` pattern for one level of child names. Unlike ``parallelize_module``
(which warns and skips), a key that resolves to no module is an error, and so is a
``ColwiseParallel`` / ``RowwiseParallel`` key that resolves to no ``nn.Linear`` (an
``nn.Embedding`` is also accepted: those styles shard embeddings too, there is nothing to swap).

The swap must run BEFORE ``parallelize_module``: the styles install forward hooks on the module
objects, and a module replaced afterwards would silently lose them. A Linear that already carries
hooks is refused for that reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatch

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from async_tp_linear.linear import TPLinear

__all__ = ["swap_tp_linears"]


def _resolve(model: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    if key == "":
        return [("", model)]
    patterns = key.split(".")
    found = []
    for name, module in model.named_modules():
        parts = name.split(".") if name else []
        if len(parts) == len(patterns) and all(
            fnmatch(p, pat) for p, pat in zip(parts, patterns, strict=True)
        ):
            found.append((name, module))
    return found


def _check_unhooked(name: str, linear: nn.Linear) -> None:
    if linear._forward_pre_hooks or linear._forward_hooks:
        raise ValueError(
            f"swap_tp_linears: {name!r} already has forward hooks (was parallelize_module applied "
            "already?); swap before parallelize_module, or the replaced module's hooks are lost"
        )


def swap_tp_linears(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[str]:
    """Replace, in place, every ``nn.Linear`` that a plan entry names with a :class:`TPLinear`.

    Args:
        model: the module that ``parallelize_module(model, mesh, plan)`` will be applied to.
        plan: module path pattern → parallel style, exactly as passed to ``parallelize_module``.

    Returns:
        The qualified names of the swapped modules, in plan order.

    A ``RowwiseParallel`` Linear with a bias gets ``reduce_output_to`` = the style's output
    layouts, so its bias is added after the reduce-scatter. Linear subclasses other than
    ``TPLinear`` (their forward may differ) are refused rather than replaced.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"swap_tp_linears: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"swap_tp_linears: plan must be a mapping of module path -> ParallelStyle, got {type(plan).__name__}"
        )
    swapped: list[str] = []
    for key, style in plan.items():
        if not isinstance(key, str) or not isinstance(style, ParallelStyle):
            raise TypeError(
                f"swap_tp_linears: plan entries must be str -> ParallelStyle, got {key!r} -> {type(style).__name__}"
            )
        matches = _resolve(model, key)
        if not matches:
            names = [n for n, _ in model.named_modules() if n][:8]
            raise ValueError(
                f"swap_tp_linears: plan key {key!r} matches no module; module names start with {names}"
            )
        if not isinstance(style, ColwiseParallel | RowwiseParallel):
            continue
        shardable = [(n, m) for n, m in matches if isinstance(m, nn.Linear | nn.Embedding)]
        if not shardable:
            kinds = sorted({type(m).__name__ for _, m in matches})
            raise ValueError(
                f"swap_tp_linears: plan key {key!r} ({type(style).__name__}) matches "
                f"{len(matches)} module(s) of type {kinds}, none of them an nn.Linear (or nn.Embedding)"
            )
        for name, module in shardable:
            if isinstance(module, nn.Embedding):
                continue
            reduce_to = None
            if isinstance(style, RowwiseParallel) and module.bias is not None:
                reduce_to = tuple(style.output_layouts)
            if isinstance(module, TPLinear):
                module.reduce_output_to = module.reduce_output_to or reduce_to
                continue
            if not name:
                raise ValueError(
                    "swap_tp_linears: the plan names the root module itself, which cannot be "
                    "replaced in place; wrap it in a parent module"
                )
            if type(module) is not nn.Linear:
                raise ValueError(
                    f"swap_tp_linears: {name!r} is a {type(module).__name__} (an nn.Linear subclass "
                    "with its own behaviour); replace it by hand"
                )
            _check_unhooked(name, module)
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, TPLinear.from_linear(module, reduce_output_to=reduce_to))
            swapped.append(name)
    return swapped
