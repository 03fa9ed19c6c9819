"""The parallel dimensions, each named once: its recipe key (``parallel.<key>``), its device-mesh
dim, what its ranks divide among themselves, and whether it adds ranks.

Everything that lists the dimensions reads :data:`DIMENSIONS` — the recipe's world size and
``--nproc`` filling (:class:`~qwen35_trainer.recipe.schema.ParallelRecipe`), the trainer's layout
(:class:`qwen35_trainer.parallel.ParallelDims`: its checks and meshes), the launcher's worker
count line, the console header and the planner — so adding a dimension means a row here, the
recipe field, the code that implements it, and its tests.

The world is the product of the degrees of the dimensions that add ranks, in :data:`DIMENSIONS`'
order, outermost first (``pp`` stages, each holding a ``(dp_replicate, dp, cp, tp)`` grid, ``tp``
innermost); ``ep`` adds none: it borrows its ranks from the ``dp × cp`` ranks that hold
different tokens (:class:`~qwen35_trainer.parallel.ParallelDims`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = [
    "DIMENSIONS",
    "RANK_DIMENSIONS",
    "Dimension",
    "degree_problems",
    "degrees",
    "product",
    "world_size",
]


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One parallel dimension (module docstring)."""

    key: str  # the recipe's parallel.<key>
    axis: str  # its device-mesh dim name (qwen35_trainer.parallel.MeshAxis)
    splits: str  # what its ranks divide
    adds_ranks: bool = True  # False: borrows ranks that another dimension added


DIMENSIONS = (
    Dimension("pp", "pp", "the decoder's layers, as pipeline stages"),
    Dimension(
        "dp_replicate", "dp_replicate", "the rows; each replica a whole sharded model (HSDP)"
    ),
    Dimension(
        "dp", "dp_shard", "the rows, and the parameters, gradients and optimizer state (FSDP)"
    ),
    Dimension("cp", "cp", "each packed row's tokens"),
    Dimension("tp", "tp", "attention heads and the shared expert (with SP, the tokens between)"),
    Dimension("ep", "ep", "the routed experts (and their tokens)", adds_ranks=False),
)
RANK_DIMENSIONS = tuple(d for d in DIMENSIONS if d.adds_ranks)


def degrees(parallel: Any) -> dict[str, int]:
    """Every dimension's degree in ``parallel`` (a ``parallel`` section), by recipe key."""
    return {d.key: getattr(parallel, d.key) for d in DIMENSIONS}


def degree_problems(parallel: Any) -> list[str]:
    """One line per degree of ``parallel`` that is not an integer >= 1."""
    return [
        f"parallel.{key} must be an integer >= 1, got {value!r}"
        for key, value in degrees(parallel).items()
        if isinstance(value, bool) or not isinstance(value, int) or value < 1
    ]


def world_size(parallel: Any, *, without: tuple[str, ...] = ()) -> int:
    """The ranks ``parallel`` needs: the product of the degrees that add ranks (those named in
    ``without`` left out)."""
    return math.prod(getattr(parallel, d.key) for d in RANK_DIMENSIONS if d.key not in without)


def product(
    parallel: Any,
    *,
    form: str = "{key} {value}",
    sep: str = " x ",
    ones: bool = True,
    without: tuple[str, ...] = (),
) -> str:
    """The world as its factors in ``form``, ``"pp 1 x dp_replicate 1 x dp 2 x cp 1 x tp 1"``
    (``ones`` false: the degrees above 1 only, ``"1"`` when none; ``without``: those left
    out)."""
    factors = [
        form.format(key=d.key, value=getattr(parallel, d.key))
        for d in RANK_DIMENSIONS
        if d.key not in without and (ones or getattr(parallel, d.key) != 1)
    ]
    return sep.join(factors) or "1"
