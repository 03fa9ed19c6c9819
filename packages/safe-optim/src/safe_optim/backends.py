"""Which optimizer to build, and whether it can take empty tensors.

An optimizer is named (``"adamw"``, ``"adam"``, ``"sgd"``, ``"te_fused_adam"``) or given as a
class, a factory function or a ``functools.partial`` of either. Every one of them is called as
``factory(param_groups, **kwargs)`` and must return a ``torch.optim.Optimizer``.

Whether a backend accepts tensors with zero elements is a property of the backend, so it is
declared once, next to the backend, instead of being passed at every call:

- ``declare_no_empty_tensors(factory)`` marks a class or function (usable as a decorator);
- subclasses of a declared class inherit the declaration (they run the same kernel);
- a partial is declared when it, or the callable it wraps, is declared (``partial`` of a
  ``partial`` flattens into a new object, so declare the wrapped callable to cover them all);
- TransformerEngine's ``FusedAdam`` is known by its module and name, so passing the class
  directly is recognised without this module importing TransformerEngine.

TransformerEngine is imported only when ``"te_fused_adam"`` is requested; a missing or broken
installation raises ``ImportError`` naming the package to install.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["OPTIMIZER_NAMES", "accepts_empty_tensors", "declare_no_empty_tensors"]

F = TypeVar("F", bound=Callable[..., Any])

_TE_FUSED_ADAM = ("transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam")
_KNOWN_NO_EMPTY: set[tuple[str, str]] = {_TE_FUSED_ADAM}
_DECLARED_NO_EMPTY: set[Any] = set()


def _load_te_fused_adam() -> Callable[..., torch.optim.Optimizer]:
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except (ImportError, OSError, RuntimeError) as err:
        raise ImportError(
            "optimizer='te_fused_adam' needs NVIDIA TransformerEngine with its PyTorch extension "
            "(pip install 'transformer-engine[pytorch]', or the 'te' extra of safe-optim) and a "
            f"CUDA GPU; importing transformer_engine.pytorch.optimizers failed: {err!r}"
        ) from err
    return FusedAdam


# name -> (loader of the factory, accepts empty tensors)
_NAMED: dict[str, tuple[Callable[[], Callable[..., torch.optim.Optimizer]], bool]] = {
    "adamw": (lambda: torch.optim.AdamW, True),
    "adam": (lambda: torch.optim.Adam, True),
    "sgd": (lambda: torch.optim.SGD, True),
    "te_fused_adam": (_load_te_fused_adam, False),
}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(sorted(_NAMED))


def declare_no_empty_tensors(factory: F) -> F:
    """Declare that the optimizer built by ``factory`` (a class, function or partial) fails on
    tensors with zero elements; ``build_optimizer`` then leaves out locally empty parameters.

    Returns ``factory`` unchanged, so it also works as a class or function decorator.
    """
    if not callable(factory):
        raise TypeError(
            f"declare_no_empty_tensors expects an optimizer class or factory, got {type(factory).__name__}"
        )
    _DECLARED_NO_EMPTY.add(factory)
    return factory


def _declared(obj: Any) -> bool:
    if isinstance(obj, type):
        return any(
            cls in _DECLARED_NO_EMPTY or (cls.__module__, cls.__qualname__) in _KNOWN_NO_EMPTY
            for cls in obj.__mro__
        )
    try:
        return obj in _DECLARED_NO_EMPTY
    except TypeError:  # unhashable callable objects cannot have been declared
        return False


def accepts_empty_tensors(factory: Callable[..., Any] | str) -> bool:
    """False when the backend (a name, class, function or partial) is declared as failing on
    tensors with zero elements; True otherwise."""
    if isinstance(factory, str):
        return _named(factory)[1]
    layer: Any = factory
    while isinstance(layer, functools.partial):
        if _declared(layer):
            return False
        layer = layer.func
    return not _declared(layer)


def _named(name: str) -> tuple[Callable[[], Callable[..., torch.optim.Optimizer]], bool]:
    if name not in _NAMED:
        raise ValueError(
            f"unknown optimizer name {name!r}; expected one of {', '.join(OPTIMIZER_NAMES)}, "
            "or an optimizer class / factory / functools.partial"
        )
    return _NAMED[name]


def resolve_optimizer(optimizer: Any) -> tuple[Callable[..., torch.optim.Optimizer], bool]:
    """``(factory, accepts_empty_tensors)`` for a name, class, function or partial."""
    if isinstance(optimizer, str):
        load, accepts_empty = _named(optimizer)
        return load(), accepts_empty
    if not callable(optimizer):
        raise TypeError(
            "optimizer must be a name or an optimizer class / factory / functools.partial, "
            f"got {type(optimizer).__name__}: {optimizer!r}"
        )
    return optimizer, accepts_empty_tensors(optimizer)
