"""The best layout for a recipe on a number of GPUs, pipeline parallelism included
(``qwen35-train plan RECIPE --search``).

Every candidate computes the SAME optimizer step as the recipe: the same samples (the synthetic
stream's ``samples_per_rank`` × data-parallel groups) or packed rows (a dataset's
``global_batch``) per step, and the same micro-batch (the recipe's samples or rows per group and
micro-batch), so the gradient accumulation of a candidate follows from its data-parallel
groups; a layout whose groups do not divide the step, or whose micro-batches are fewer than its
schedule needs, is refused with the planner's reason. What differs is where the bytes live, what
crosses the nodes and how long the pipeline idles, so the candidates are comparable.

Candidates (the recipe's ``tp``, SP and schedule kept):

- ``pp``: every divisor of the world up to the decoder layers (``--pp`` to choose);
- ``cp``: every divisor of the recipe's ``cp`` that divides the stage's ranks (the recipe's
  rows were sized for at most that much context parallelism);
- FSDP over the whole stage (``dp = stage ranks / (cp·tp)``) and, when that group spans nodes,
  HSDP keeping each shard group inside one node of ``node_gpus`` (``dp_replicate`` the rest);
- ``ep``: the largest divisor of ``dp·cp`` and of the routed experts, at most the recipe's.

The ranking, best first: the layouts that fit; then the shortest predicted step
(:func:`.timing.step_time` on the ``gpu``: compute, exposed communication over NVLink or
InfiniBand, the pipeline's fill and drain, the optimizer); then the fewest bytes one rank sends
over groups spanning nodes per step (:func:`inter_node_bytes`); then the smallest bubble; then
the lowest predicted peak. The bytes over nodes and the bubble stay as columns: they are in the
step time already, and say why a layout is slow. A layout whose parameters, gradients and Adam
moments alone
(``16 B`` per trained parameter, the stored bytes of a frozen one, spread evenly) exceed the
GPU is reported without planning it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

from qwen35_trainer.model.config import build_config
from qwen35_trainer.parallel import ParallelDims
from qwen35_trainer.plan.hardware import Hardware, hardware
from qwen35_trainer.plan.nodes import crossing_groups
from qwen35_trainer.plan.planner import GIB, Plan, plan
from qwen35_trainer.plan.timing import Efficiency, StepTime, step_time
from qwen35_trainer.recipe.dimensions import degrees

__all__ = ["Candidate", "candidates", "inter_node_bytes", "search"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout of the search: its ``--set`` overrides over the recipe, the recipe they make,
    and the verdict: a :class:`Plan`, or the reason it was not planned or cannot run."""

    layout: dict[str, int]  # the degree of each dimension (recipe.dimensions.degrees)
    sets: tuple[str, ...]
    recipe: object | None
    plan: Plan | None = None
    reason: str = ""
    inter_node: int = 0  # bytes one rank sends over node-spanning groups per step (max rank)
    time: StepTime | None = None  # the planned layout's step on the search's GPU

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.fits

    def rank_key(self) -> tuple:
        """The ranking (module docstring): fitting first, then the step time, inter-node bytes,
        bubble, peak."""
        if self.plan is None or self.time is None:
            return (2, 0.0, 0, 0.0, 0.0)
        return (
            int(not self.fits),
            self.time.seconds,
            self.inter_node,
            self.plan.bubble or 0.0,
            self.plan.peak_gib,
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _step_size(recipe) -> tuple[int, int, str]:
    """``(per step, per micro-batch and group, what)``: the samples (synthetic stream) or packed
    rows (dataset) of the recipe's step and of one micro-batch of one data-parallel group."""
    data, p, accum = recipe.data, recipe.parallel, recipe.train.grad_accum_steps
    groups = p.dp_replicate * p.dp
    if data.dataset:
        rows = data.rows_per_step(groups)
        return rows, max(1, rows // groups // accum), "rows"
    return data.samples_per_rank * groups, max(1, data.samples_per_rank // accum), "samples"


def _layout_sets(recipe, layout: dict[str, int]) -> list[str] | str:
    """The overrides of one layout (its degree per dimension, :data:`~qwen35_trainer.recipe.
    dimensions.DIMENSIONS`) keeping the recipe's step (module docstring), or why the step does
    not divide over its data-parallel groups."""
    per_step, per_micro, what = _step_size(recipe)
    groups = layout["dp_replicate"] * layout["dp"]
    if per_step % (groups * per_micro):
        return f"the step's {per_step} {what} do not split over {groups} groups by {per_micro}"
    micro = per_step // (groups * per_micro)
    sets = [f"parallel.{key}={degree}" for key, degree in layout.items()]
    sets.append(f"train.grad_accum_steps={micro}")
    if not recipe.data.dataset:
        sets.append(f"data.samples_per_rank={per_step // groups}")
    stated = recipe.parallel.pp_microbatches
    if layout["pp"] > 1 and stated is not None and stated != micro:  # = grad_accum_steps
        sets.append(f"parallel.pp_microbatches={micro}")
    return sets


def candidates(
    recipe, world: int, *, node_gpus: int, pp_values: list[int] | None = None
) -> Iterator[tuple[dict[str, int], list[str] | str]]:
    """Each layout of the search (module docstring) as ``(its degree per dimension, in
    :data:`~qwen35_trainer.recipe.dimensions.DIMENSIONS`' order; the overrides or the reason it
    cannot keep the step)``."""
    p, text = recipe.parallel, build_config(recipe.model).text_config
    layers, experts = text.num_hidden_layers, text.num_experts
    tp = p.tp
    for pp in pp_values or [d for d in _divisors(world) if d <= layers]:
        if world % (pp * tp):
            continue
        shard_all = world // (pp * tp)  # the stage's ranks holding different tokens
        for cp in [c for c in _divisors(math.gcd(p.cp, shard_all))]:
            shards = [shard_all]
            in_node = [s for s in _divisors(shard_all) if s % cp == 0 and s * tp <= node_gpus]
            if shard_all * tp > node_gpus and in_node and max(in_node) < shard_all:
                shards.append(max(in_node))  # HSDP: each shard group inside one node
            for shard in shards:
                ep = max(d for d in _divisors(math.gcd(shard, experts)) if d <= max(p.ep, 1))
                chosen = dict(pp=pp, dp_replicate=shard_all // shard, dp=shard // cp, cp=cp, ep=ep)
                layout = {**degrees(p), **chosen}
                yield layout, _layout_sets(recipe, layout)


def inter_node_bytes(planned: Plan, dims: ParallelDims, node_gpus: int) -> int:
    """The most bytes a planned rank sends per step over groups spanning nodes."""
    crossing = crossing_groups(dims, node_gpus)
    return max(
        sum(n for kind, n in traffic.items() if kind in crossing)
        for traffic in planned.rank_traffic.values()
    )


def _state_bound_gib(recipe, total: int, ranks_per_replica: int) -> float:
    """A lower bound on the worst rank's parameters, gradients and Adam moments: ``total``
    parameters spread evenly over the ranks of one model replica (``16 B`` each when they train;
    under LoRA the frozen base's stored bytes, fp8 or bf16, the adapters left out)."""
    per = 16 if recipe.model.lora is None else (1 if recipe.model.fp8_base else 2)
    return total * per / ranks_per_replica / GIB


def search(
    recipe,
    load: Callable[[list[str]], object],
    *,
    world: int,
    node_gpus: int = 8,
    gpu_memory_gib: float = 80.0,
    pp_values: list[int] | None = None,
    planner: Callable[..., Plan] = plan,
    on_candidate: Callable[[Candidate], None] | None = None,
    gpu: Hardware | None = None,
    efficiency: Efficiency | None = None,
) -> list[Candidate]:
    """Every candidate layout of ``recipe`` on ``world`` GPUs, best first (module docstring);
    ``load(sets)``: the recipe with those overrides (``ValueError`` for one that cannot be);
    ``on_candidate``: called with each as it is decided (progress); ``gpu`` (default the H100)
    and ``efficiency``: what the step is timed on."""
    from qwen35_trainer.model.build import build_meta_model
    from qwen35_trainer.plan.planner import parameter_counts

    total = parameter_counts(build_meta_model(recipe.model))[0]
    found = []
    for layout, sets in candidates(recipe, world, node_gpus=node_gpus, pp_values=pp_values):
        if isinstance(sets, str):
            found.append(Candidate(layout, (), None, reason=sets))
        else:
            decided = _decide(
                recipe, load, layout, sets, total, world, node_gpus, gpu_memory_gib, planner
            )
            if decided.plan is not None:
                timed = step_time(decided.plan, gpu or hardware(), efficiency, node_gpus)
                decided = dataclasses.replace(decided, time=timed)
            found.append(decided)
        if on_candidate is not None:
            on_candidate(found[-1])
    return sorted(found, key=Candidate.rank_key)


def _decide(recipe, load, layout, sets, total, world, node_gpus, gpu_memory_gib, planner):
    """One :class:`Candidate`'s verdict: refused, bounded without planning, or planned."""
    sets = tuple(sets)
    try:
        candidate = load(list(sets))
    except ValueError as err:
        return Candidate(layout, sets, None, reason=str(err))
    p = candidate.parallel
    bound = _state_bound_gib(recipe, total, world // p.dp_replicate)
    if bound > gpu_memory_gib:
        return Candidate(
            layout,
            sets,
            candidate,
            reason=f"parameters, gradients and optimizer state alone >= {bound:.1f} GiB",
        )
    try:
        planned = planner(
            candidate, name="candidate", world_size=world, gpu_memory_gib=gpu_memory_gib
        )
    except ValueError as err:
        return Candidate(layout, sets, candidate, reason=str(err))
    dims = ParallelDims.from_recipe(p, world)
    crossing = inter_node_bytes(planned, dims, node_gpus)
    return Candidate(layout, sets, candidate, planned, inter_node=crossing)
