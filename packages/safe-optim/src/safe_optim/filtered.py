"""Keep parameters with an empty LOCAL shard away from a backend that cannot take them.

Why leaving such a parameter out is exact: an optimizer step is elementwise over a parameter's
elements (Adam, AdamW, SGD, and TransformerEngine's fused Adam all are); a rank whose local shard
of a parameter has no elements has nothing to update, and the ranks that hold the elements update
them exactly as before. Nothing global (norms, counts) is computed across parameters by these
optimizers, so the kept parameters' updates do not change either.

Why the parameters stay visible in ``param_groups``: LR schedulers, ``torch.distributed.
checkpoint`` (``get_optimizer_state_dict`` / ``set_optimizer_state_dict``) and plain
``state_dict`` / ``load_state_dict`` all index parameter groups by position and match them by the
parameters they list. If each rank dropped different parameters from its groups, a group could
become empty on some ranks but not on others, and DCP (which saves ONE copy of each group's
parameter list) could not match it on load. So every rank keeps the full, identical groups, with
their options; only ``step`` hands the backend the filtered view: the same group dicts (so
options, LR changes and anything the backend writes into a group persist) listing only the kept
parameters, and only the groups that keep at least one. A parameter that was left out gets an
empty state entry ``{}`` at the step where the backend would have created its state, so the
rank's state dict names every parameter (DCP's strict load asks for that) while saving no tensor
for it: its elements' state is saved by the ranks that own them, and on load, at any world size,
each rank reads the state of the elements it owns.

The optimizer keeps its class and behaviour through a subclass created per backend class and
installed with ``__class__`` assignment (the same technique ``fully_shard`` uses for modules):
``isinstance`` checks, the backend's ``state_dict`` / ``load_state_dict`` and step hooks keep
working. Limits: parameters must keep their sharding for the optimizer's lifetime (which
parameters are empty is decided when they are added); the dynamic class cannot be pickled.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["local_numel"]

logger = logging.getLogger("safe_optim")


def local_numel(t: torch.Tensor) -> int:
    """Number of elements this rank holds: a DTensor's local shard, else the tensor itself."""
    if DTensor is not None and isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local().numel()
    return t.numel()


class _SkipEmptyLocalShards:
    """Mixin placed before the backend class; see the module docstring."""

    _safe_optim_left_out: set[int]

    def step(self, *args: Any, **kwargs: Any) -> Any:
        groups: list[dict[str, Any]] = self.param_groups  # type: ignore[attr-defined]
        full = [g["params"] for g in groups]
        left_out = self._safe_optim_left_out
        try:
            for group, params in zip(groups, full, strict=True):
                group["params"] = [p for p in params if id(p) not in left_out]
            self.param_groups = [g for g in groups if g["params"]]
            loss = super().step(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.param_groups = groups
            for group, params in zip(groups, full, strict=True):
                group["params"] = params
        state = self.state  # type: ignore[attr-defined]
        for params in full:
            for p in params:
                if id(p) in left_out and p.grad is not None and p not in state:
                    state[p] = {}
        return loss

    # The backend's own step is already wrapped with the step hooks; without this mark,
    # ``Optimizer.__setstate__`` (run by ``load_state_dict``) would wrap this one as well and
    # every hook would run twice per step.
    step.hooked = True  # type: ignore[attr-defined]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        added = self.param_groups[-1]["params"]  # type: ignore[attr-defined]
        self._safe_optim_left_out.update(id(p) for p in added if local_numel(p) == 0)


_FILTERED_CLASSES: dict[type, type] = {}


def _filtered_class(cls: type) -> type:
    if issubclass(cls, _SkipEmptyLocalShards):
        return cls
    sub = _FILTERED_CLASSES.get(cls)
    if sub is None:
        sub = type(f"SkipEmpty{cls.__name__}", (_SkipEmptyLocalShards, cls), {})
        _FILTERED_CLASSES[cls] = sub
    return sub


def build_skipping_empty(
    groups: Sequence[dict[str, Any]], factory: Any, kwargs: dict[str, Any]
) -> torch.optim.Optimizer:
    """Build ``factory`` on the groups minus their locally empty parameters, then give it back
    the full groups and the filtering ``step``. ``groups`` are normalised (``params`` lists)."""
    kept = [[p for p in g["params"] if local_numel(p) > 0] for g in groups]
    opt = factory([{**g, "params": k} for g, k in zip(groups, kept, strict=True)], **kwargs)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"the optimizer factory returned {type(opt).__name__}, expected a torch.optim.Optimizer"
        )
    if len(opt.param_groups) != len(groups):
        raise ValueError(
            f"the optimizer built {len(opt.param_groups)} param groups from {len(groups)}; "
            "a backend that cannot take empty tensors must keep one group per given group"
        )
    backend = type(opt).__name__
    left_out: set[int] = set()
    for group, given, k in zip(opt.param_groups, groups, kept, strict=True):
        kept_ids = {id(p) for p in k}
        left_out.update(id(p) for p in given["params"] if id(p) not in kept_ids)
        group["params"] = list(given["params"])
    opt.__class__ = _filtered_class(type(opt))
    opt._safe_optim_left_out = left_out  # type: ignore[attr-defined]
    _log_left_out(backend, groups, kept)
    return opt


def _log_left_out(
    backend: str, groups: Sequence[dict[str, Any]], kept: Sequence[Sequence[torch.Tensor]]
) -> None:
    total = sum(len(g["params"]) for g in groups)
    n_out = total - sum(len(k) for k in kept)
    idle = [i for i, k in enumerate(kept) if not k]
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    logger.info(
        "rank %d: %s leaves out %d of %d parameters whose local shard is empty%s",
        rank,
        backend,
        n_out,
        total,
        f"; param groups {idle} keep nothing on this rank (kept in place, skipped by step)"
        if idle
        else "",
    )
