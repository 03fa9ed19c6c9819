"""What the planner needs of a pipeline-parallel rank (``parallel.pp > 1``): which decoder layers
it holds, whether it holds the first stage (vision tower, embeddings) or the last (head, MTP,
loss), how many micro-batches' activations it holds at its peak, the bubble, and the bytes its
stage boundaries send.

In flight (the activations saved for the backward at a rank's peak, in micro-batches of its
stages), for pipeline rank ``r`` of ``pp`` over ``m`` micro-batches with ``v`` stages per rank:

- GPipe: every micro-batch's forward runs before any backward: ``m``;
- 1F1B: rank ``r`` runs ``pp - r`` forwards before its first backward, then one of each:
  ``min(m, pp - r)``;
- interleaved 1F1B: ``(v - 1)·pp + 2·(pp - 1 - r) + 1`` stage forwards before the first
  backward (Megatron's warm-up count, the schedule torch runs), each holding ``1/v`` of the
  rank's layers: that many over ``v`` micro-batches of all its layers, at most ``m``.

Bubble (the share of a step a rank idles, equal-cost stages): ``(pp - 1) / (m + pp - 1)``
for GPipe and 1F1B, ``(pp - 1) / (v·m + pp - 1)`` interleaved, and ``(pp - 1) / (3·v·m + pp -
1)`` for interleaved zero bubble: with the forward, the inputs' backward and the weights'
backward taking equal time (ZB-H1's model), the deferred weight passes fill two thirds of the
interleaved bubble. Its in-flight count is interleaved 1F1B's plus one stage chunk: the
chunk whose weights' backward is deferred past the next forward keeps its saved tensors until
that pass runs.

``forwards_first``: every forward of the step runs on this rank before its first backward
(GPipe; 1F1B's and interleaved 1F1B's ranks whose warm-up covers all ``m`` micro-batches), and
that backward makes the weights' gradients as it frees the saved tensors (not a split
backward). Then the first backward trades one micro-batch's activations for the stage's
gradients, and no later forward brings activations back on top of them
(:mod:`qwen35_trainer.plan.memory`'s ``freed_for_grads``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from qwen35_trainer.parallel.pipeline_split import SPLIT_BACKWARD

__all__ = ["StageView", "bubble_fraction", "p2p_bytes", "stage_view"]


@dataclasses.dataclass(frozen=True)
class StageView:
    """One pipeline rank's part of the model and of the schedule (module docstring)."""

    layer_types: tuple[str, ...]
    first: bool
    last: bool
    in_flight: float
    sends: int  # stage boundaries it sends across (forward activations; gradients back)
    receives: int
    forwards_first: bool = False  # module docstring


def stage_view(pipeline: Any, layer_types: list[str], microbatches: int, pp: int) -> StageView:
    """The view of the rank whose built pipeline is ``pipeline``
    (:class:`qwen35_trainer.model.pipeline.build.Pipeline`)."""
    plan = pipeline.plan
    count, v, rank = len(plan.stage_layers), len(plan.mine), plan.mine[0]
    held = tuple(layer_types[i] for s in plan.mine for i in plan.stage_layers[s])
    if plan.schedule == "gpipe":
        in_flight = float(microbatches)
    elif v == 1:
        in_flight = float(min(microbatches, pp - rank))
    else:
        chunks = (v - 1) * pp + 2 * (pp - 1 - rank) + 1
        chunks += plan.schedule in SPLIT_BACKWARD  # the chunk whose weights' pass is deferred
        in_flight = min(float(microbatches), chunks / v)
    return StageView(
        layer_types=held,
        first=0 in plan.mine,
        last=count - 1 in plan.mine,
        in_flight=in_flight,
        sends=sum(s < count - 1 for s in plan.mine),
        receives=sum(s > 0 for s in plan.mine),
        forwards_first=in_flight == microbatches and plan.schedule not in SPLIT_BACKWARD,
    )


def bubble_fraction(schedule: str, pp: int, virtual: int, microbatches: int) -> float:
    """The share of a step each rank idles (module docstring)."""
    chunks = microbatches * (virtual if schedule != "gpipe" else 1)
    if schedule in SPLIT_BACKWARD:  # each chunk's time in thirds, one of which fills the bubble
        chunks *= 3
    return (pp - 1) / (chunks + pp - 1)


def p2p_bytes(text: Any, view: StageView, microbatches: int, tokens: int, row: int, b: int) -> int:
    """Bytes one rank sends between stages in a step: per micro-batch and boundary, forward the
    hidden states of its ``tokens`` (``b`` bytes each), the router statistics (``2E + 1`` fp32)
    and, with the MTP head, the whole ``row``'s embeddings; backward their gradients (the
    counts carry none)."""
    h, e = text.hidden_size, text.num_experts
    mtp = row * h * b if getattr(text, "mtp_num_hidden_layers", 0) else 0
    forward = tokens * h * b + (2 * e + 1) * 4 + mtp
    backward = tokens * h * b + e * 4 + mtp
    return microbatches * (view.sends * forward + view.receives * backward)
