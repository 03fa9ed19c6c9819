"""Where a parameter's starting value comes from: one interface every source implements.

A parameter starts from one of five places: a checkpoint's values (an FP8 tensor dequantized
where the runtime holds floats), a checkpoint's FP8 bytes and scales as stored, full-precision
values quantized on load (a bf16 checkpoint, or the seeded values, under an FP8 base), the
name-seeded initialisation, or an adapter folder (LoRA's ``init_from``). Each source is a
:class:`WeightSource`:

- ``plan(whole, problems)`` checks what the source holds against the WHOLE model
  (:func:`qwen35_trainer.model.whole.whole_parameters`: every parameter, whichever pipeline
  stage holds it), appending one line per mismatch to ``problems``, and returns a
  :data:`RowReader` for each parameter it fills that this rank holds;
- ``refusal(problems)`` is the one error message those lines make.

A :data:`RowReader` ``(lo, hi)`` gives rows ``lo:hi`` (dim 0) of the parameter's FULL runtime
value; :func:`~qwen35_trainer.model.weights.shards.read_local` cuts this rank's shard from it,
so a source never learns the layout and every layout reads what one process reads.

:func:`plan_fill` runs the sources in order, a later source's readers replacing an earlier
one's (the seeded initialisation first: what no other source fills starts from it). Judged on
the whole model, every rank finds the same problems; the ranks still agree on them (one
all-reduce per source on the group's device) before all raise the same ``ValueError``, so a
source that does not fit is one message naming the tensor on every layout and no rank waits in
a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from qwen35_trainer.model.whole import WholeParameter, whole_parameters
from qwen35_trainer.parallel.dist import any_rank

__all__ = ["RowReader", "WeightSource", "plan_fill"]

RowReader = Callable[[int, int], torch.Tensor]


class WeightSource(Protocol):
    """A place parameters start from (module docstring)."""

    def plan(self, whole: list[WholeParameter], problems: list[str]) -> dict[str, RowReader]:
        """A reader per parameter name this source fills and this rank holds; every mismatch
        with the whole model appended to ``problems``."""
        ...

    def refusal(self, problems: list[str]) -> str:
        """The one error message of ``problems`` (``[]`` when another rank found them)."""
        ...


def plan_fill(
    model: nn.Module, sources: Sequence[WeightSource], device: torch.device | str
) -> dict[str, RowReader]:
    """The reader of each of this rank's parameters, from ``sources`` in order (module
    docstring); ``ValueError`` on every rank for the first source that does not fit."""
    whole = whole_parameters(model)
    readers: dict[str, RowReader] = {}
    for source in sources:
        problems: list[str] = []
        found = source.plan(whole, problems)
        if any_rank(bool(problems), torch.device(device)):
            raise ValueError(source.refusal(problems))
        readers |= found
    return readers


def listed(problems: list[str], limit: int = 20) -> str:
    """``problems`` joined, the first ``limit`` of them, or who found them."""
    if not problems:
        return "(found by another rank)"
    more = f" ... and {len(problems) - limit} more" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more
