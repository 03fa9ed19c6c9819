"""The whole model, seen from a rank that holds part of it.

Under pipeline parallelism a rank keeps only its stages' modules (:func:`qwen35_trainer.model.
pipeline.stages.keep_stages`); each module another stage holds is replaced by an
:class:`Elsewhere`, which has no parameters but keeps the module it replaces — still on the
meta device, unregistered: its names, shapes, FP8 roles and adapters, no storage — and the
pipeline rank that holds it. Whatever must be judged against the WHOLE model reads it through
:func:`whole_parameters` / :func:`whole_modules`: whether a checkpoint or an adapter folder
fits the model (a tensor another stage holds is expected, not "on disk, not in the model"),
which modules a LoRA run trains in full, where an export writes each tensor. Whatever is filled,
trained or gathered reads the rank's own parameters (``here``). Without PP the whole model is
the rank's model and every entry is ``here``.

The order is the one-process module order (``nn.Module.named_modules``), with each held
module's subtree in the place of its :class:`Elsewhere`: every rank lists the same names in the
same order, whatever it holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from torch import nn

from qwen35_trainer.model.params import canonical_name

__all__ = ["Elsewhere", "WholeParameter", "held", "whole_modules", "whole_parameters"]


class Elsewhere(nn.Module):
    """Stands where a module another pipeline stage holds would be: no parameters, and it
    refuses to run. ``held``: the module it replaces (on the meta device), ``pp_rank``: the
    pipeline rank holding it."""

    def __init__(self, name: str, held_module: nn.Module, pp_rank: int) -> None:
        super().__init__()
        live = [n for n, p in held_module.named_parameters() if not p.is_meta]
        if live:
            raise ValueError(
                f"{name} is dropped from this pipeline rank while its parameters are allocated "
                f"(e.g. {live[0]}): stages are kept on the meta device, before materialising"
            )
        self.held_name = name
        self.pp_rank = pp_rank
        self._held = (held_module,)  # a tuple: not a submodule, so no parameter of this rank

    @property
    def held(self) -> nn.Module:
        return self._held[0]

    def forward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{self.held_name} is held by another pipeline stage")


class WholeParameter(NamedTuple):
    """A parameter of the whole model: its canonical name, module, attribute, the parameter
    (meta when another stage holds it), and who holds it: ``holder`` is ``None`` when this rank
    does (``here``), else the pipeline rank that does."""

    name: str
    module: nn.Module
    attr: str
    param: Any
    holder: int | None

    @property
    def here(self) -> bool:
        return self.holder is None


def whole_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, int | None]]:
    """``(canonical path, module, holder)`` for every module of the whole model, in module
    order (module docstring; ``holder``: as :class:`WholeParameter`'s); an :class:`Elsewhere`
    itself is not listed, its held subtree is."""
    seen: set[int] = set()

    def walk(module: nn.Module, path: str, holder: int | None):
        if id(module) in seen:
            return
        seen.add(id(module))
        if isinstance(module, Elsewhere):
            yield from walk(module.held, path, module.pp_rank)
            return
        yield canonical_name(path), module, holder
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{path}.{name}" if path else name, holder)

    yield from walk(model, "", None)


def whole_parameters(model: nn.Module) -> list[WholeParameter]:
    """Every parameter of the whole model, in module order (module docstring)."""
    return [
        WholeParameter(f"{path}.{attr}" if path else attr, module, attr, param, holder)
        for path, module, holder in whole_modules(model)
        for attr, param in module._parameters.items()
        if param is not None
    ]


def held(model: nn.Module, name: str) -> bool:
    """Whether this rank holds ``model``'s module ``name`` (no :class:`Elsewhere` on its
    path)."""
    try:
        return not isinstance(model.get_submodule(name), Elsewhere)
    except AttributeError:  # under a module another stage holds
        return False
