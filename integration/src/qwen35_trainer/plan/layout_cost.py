"""What each parallel dimension costs beyond the terms :mod:`.measured_time` prices, measured:
the recipe at that dimension's degree 2 (``cp``: CP 2; ``ep``: DP 2 × EP 2, EP borrowing the
data-parallel ranks; ``tp``: TP 2 with sequence parallelism) runs on 2 local ranks
(:func:`.local_ranks.run_on_local_ranks`), each timing one step (:func:`.step_probe.probe_step`),
and the slower rank's micro-batch and once-per-step seconds are compared with what the
profile's own terms predict for that rank of that plan (its classes, calls, unexplained work,
links and optimizer). The excess, never below 0, is the dimension's own machinery that one
process never runs: the layout's extra op calls (the CP split and its permutations, EP's
dispatch: sort, split sizes, index), and DTensor's sharding propagation on every op of a
TP-sharded tensor (its forward and backward, its clipping and optimizer step), which costs far
more per call than a plain aten op. A plan with that dimension pays it per micro-batch (times
its share of the decoder's layers) and per step."""

from __future__ import annotations

import dataclasses

from qwen35_trainer.plan.local_ranks import run_on_local_ranks
from qwen35_trainer.plan.step_probe import probe_step, single_process
from qwen35_trainer.plan.traffic import PER_MICROBATCH

__all__ = ["DIMENSIONS", "layout_costs"]

# each of :data:`.profile.LAYOUT_DIMENSIONS` at degree 2, as the recipe's degrees
DIMENSIONS = {"cp": {"cp": 2}, "ep": {"dp": 2, "ep": 2}, "tp": {"tp": 2}}
TIMEOUT_S = 600


def at_two(recipe, dim: str):
    """The one-process recipe with ``dim`` at degree 2 (:data:`DIMENSIONS`)."""
    one = single_process(recipe)
    return dataclasses.replace(one, parallel=dataclasses.replace(one.parallel, **DIMENSIONS[dim]))


def _probe(rank: int, ranks: int, device, recipe) -> tuple[dict[str, float], int]:
    from qwen35_trainer.parallel import validate_layout

    probe = probe_step(recipe, device, validate_layout(recipe, ranks))
    return probe.seconds, probe.microbatches


def layout_costs(recipe, profile, dims: list[str]) -> dict[str, dict[str, float]]:
    """``{dim: {"microbatch": s, "step": s}}`` for each of ``dims`` (module docstring), priced
    with ``profile`` (whose own ``layouts`` are not used)."""
    from qwen35_trainer.plan.measured_time import Measured
    from qwen35_trainer.plan.planner import plan

    costs = {}
    for dim in dims:
        two = at_two(recipe, dim)
        ranks = run_on_local_ranks(2, _probe, two, what=f"timing {dim} 2", timeout=TIMEOUT_S)
        seconds = {k: max(r[0][k] for r in ranks.values()) for k in ("microbatch", "step")}
        m = next(iter(ranks.values()))[1]
        planned = plan(two, name=f"{dim} 2")
        prices = Measured(profile, m, {})
        work, mem, traffic = planned.work[0], planned.ranks[0], planned.rank_traffic[0]
        per_micro = sum(prices.link(k, n, work) for k, n in traffic.items() if k in PER_MICROBATCH)
        once = sum(prices.link(k, n, work) for k, n in traffic.items() if k not in PER_MICROBATCH)
        predicted_micro = prices.compute(work) + per_micro / m
        predicted_once = prices.optimizer(mem, m) - profile.data_s + once
        costs[dim] = {
            "microbatch": max(seconds["microbatch"] - predicted_micro, 0.0),
            "step": max(seconds["step"] - m * seconds["microbatch"] - predicted_once, 0.0),
        }
    return costs
