"""Which decoder layers each pipeline stage holds, which stages a rank runs, and what a
pipeline layout refuses (before any worker starts).

Stages: ``n = pp * pp_virtual_stages`` contiguous runs of decoder layers, stage ``s`` on pipeline
rank ``s % pp`` (the loop placement torch's interleaved schedules run). The first stage also
holds the token embedding and the vision tower with its merger; the last the final norm,
``lm_head``, the MTP head and the loss.

The default split balances a per-layer cost (:func:`qwen35_trainer.model.flops.layer_costs`:
full attention and Gated DeltaNet layers differ; the first stage is charged the vision tower,
the last the head and the MTP layers): :func:`balanced_split` minimises the most expensive
stage exactly, then the sum of the stages' squared costs (dynamic programmes over the cut
points); a run whose data differs from the cost model's assumption gives
``parallel.pp_layers``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PP_SCHEDULES",
    "SPLIT_BACKWARD",
    "ZERO_BUBBLE_V",
    "balanced_split",
    "pipeline_refusals",
    "stages_of_rank",
]

# the recipe's names -> torch.distributed.pipelining's classes, and the stages per rank each runs
PP_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "multi"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "multi"),
}
# schedules that split each backward into the inputs' gradients, then the weights' from the
# retained graph (zero bubble): the last stage's cross-entropy takes chunked-loss's recompute
# path (its fused path forms the gradients in the forward and refuses a second backward), and
# each stage's FSDP units stay unsharded from their forward to the step's end (resharded
# between the two, the weights' pass would write gradients FSDP never reduces)
SPLIT_BACKWARD = ("interleaved_zb",)
# torch's V-shaped zero-bubble schedules place stages s and 2·pp − 1 − s on one rank
ZERO_BUBBLE_V = ("zbv", "dualpipev")


def pipeline_refusals(recipe: Any, text_config: Any | None) -> list[str]:
    """Why the recipe's pipeline settings cannot run (empty: they can, or ``pp = 1`` with the
    other ``pp_*`` settings at their defaults)."""
    p = recipe.parallel
    if p.pp == 1:
        if p.pp_virtual_stages != 1 or p.pp_layers is not None:
            return ["parallel.pp_virtual_stages / pp_layers need parallel.pp > 1"]
        return []
    if not isinstance(p.pp, int) or p.pp < 1:
        return [f"parallel.pp must be an integer >= 1, got {p.pp!r}"]
    train, data = recipe.train, recipe.data
    reasons = []
    kind = PP_SCHEDULES.get(p.pp_schedule, (None, None))[1]
    v = p.pp_virtual_stages
    if p.pp_schedule in ZERO_BUBBLE_V:
        reasons.append(
            f"parallel.pp_schedule={p.pp_schedule} (V-shaped zero bubble) is not built yet: it "
            "places stages s and 2·pp − 1 − s on one rank, the trainer places stage s on rank "
            "s % pp; use interleaved_zb (zero bubble, interleaved placement)"
        )
    elif kind is None:
        reasons.append(
            f"parallel.pp_schedule must be one of {tuple(PP_SCHEDULES)}, got {p.pp_schedule!r}"
        )
    elif kind == "single" and v != 1:
        reasons.append(
            f"parallel.pp_schedule={p.pp_schedule} runs one stage per rank: "
            f"parallel.pp_virtual_stages must be 1, got {v} (or use interleaved_1f1b)"
        )
    elif kind == "multi" and (not isinstance(v, int) or v < 2):
        reasons.append(
            f"parallel.pp_schedule={p.pp_schedule} interleaves stages: "
            f"parallel.pp_virtual_stages must be >= 2, got {v!r}"
        )
    micro = p.pp_microbatches
    if micro is not None and micro != train.grad_accum_steps:
        reasons.append(
            f"parallel.pp_microbatches={micro} must equal train.grad_accum_steps="
            f"{train.grad_accum_steps}: each pipeline micro-batch is one accumulation "
            "micro-batch (one packed row); set one, or both alike"
        )
    micro = train.grad_accum_steps
    if p.pp_schedule == "1f1b" and micro < p.pp:
        reasons.append(
            f"parallel.pp_schedule=1f1b needs at least parallel.pp={p.pp} micro-batches "
            f"(train.grad_accum_steps), got {micro}"
        )
    if kind == "multi" and micro % max(1, micro // p.pp):
        reasons.append(
            f"parallel.pp_schedule={p.pp_schedule} needs train.grad_accum_steps={micro} to be "
            f"a multiple of its rounds, max(1, grad_accum_steps // pp={p.pp})"
        )
    if not data.packing or data.pack_length is None:
        reasons.append(
            "parallel.pp > 1 needs data.packing with data.pack_length: the stages exchange "
            "each micro-batch's hidden states in buffers of one fixed shape, so every "
            "micro-batch is one packed row padded to its capacity"
        )
    if train.compile:
        reasons.append("train.compile with parallel.pp > 1 is not built yet")
    if p.tp > 1 and not p.sp:
        reasons.append(
            "parallel.tp > 1 with parallel.pp > 1 runs with sequence parallelism (the stages "
            "pass each TP rank's slice of the tokens): leave parallel.sequence_parallel on"
        )
    if p.fsdp_backend != "fsdp2":
        reasons.append("parallel.pp > 1 runs with parallel.fsdp_backend=fsdp2 only")
    if text_config is not None and kind is not None:
        reasons += _split_refusals(p, text_config.num_hidden_layers)
    return reasons


def _split_refusals(p: Any, layers: int) -> list[str]:
    stages = p.pp * p.pp_virtual_stages
    if p.pp_layers is None:
        if layers < stages:
            return [
                f"the model has {layers} decoder layers, fewer than parallel.pp x "
                f"pp_virtual_stages = {stages} stages (each holds one at least)"
            ]
        return []
    counts = p.pp_layers
    if len(counts) != stages or any(not isinstance(c, int) or c < 1 for c in counts):
        return [
            f"parallel.pp_layers must list {stages} layer counts >= 1 (pp x "
            f"pp_virtual_stages), got {list(counts)}"
        ]
    if sum(counts) != layers:
        return [f"parallel.pp_layers={list(counts)} sums to {sum(counts)}, not the {layers} layers"]
    return []


def balanced_split(costs: list[float], stages: int, first: float, last: float) -> list[int]:
    """Layer counts of ``stages`` contiguous stages (each >= 1 layer) minimising the most
    expensive stage (the first charged ``first`` more, the last ``last`` more) and, among those
    splits, the sum of the stages' squared costs: the other stages are balanced too, not left
    anywhere below the bottleneck (a first stage made expensive by the vision tower would
    otherwise let any split of the rest pass)."""
    bound = _least_maximum(costs, stages, first, last)
    return _least_squares(costs, stages, first, last, bound * (1 + 1e-12))


def _stage_cost(prefix: list[float], stages: int, first: float, last: float):
    def cost(stage: int, a: int, b: int) -> float:
        extra = (first if stage == 0 else 0.0) + (last if stage == stages - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    return cost


def _prefix(costs: list[float]) -> list[float]:
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    return prefix


def _least_maximum(costs: list[float], stages: int, first: float, last: float) -> float:
    """The least possible most expensive stage (a dynamic programme over the cut points:
    ``best[s][i]``, the least maximum of stages 0..s-1 over layers 0..i-1)."""
    n, cost = len(costs), _stage_cost(_prefix(costs), stages, first, last)
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            best[s][i] = min(max(best[s - 1][j], cost(s - 1, j, i)) for j in range(s - 1, i))
    return best[stages][n]


def _least_squares(
    costs: list[float], stages: int, first: float, last: float, bound: float
) -> list[int]:
    """The split with every stage at most ``bound`` whose squared stage costs sum least."""
    n, cost = len(costs), _stage_cost(_prefix(costs), stages, first, last)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                c = cost(s - 1, j, i)
                if c <= bound and best[s - 1][j] + c * c < best[s][i]:
                    best[s][i], cut[s][i] = best[s - 1][j] + c * c, j
    counts, i = [], n
    for s in range(stages, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    return counts[::-1]


def stages_of_rank(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs (loop placement: ``pp_rank + v * pp``)."""
    return [pp_rank + v * pp for v in range(virtual)]
