"""A plan's work priced on a measured machine (:class:`.profile.Profile`), for
:func:`.timing.step_time`; the pipeline and step-level rules stay :mod:`.timing`'s.

Per planned rank and micro-batch:

- **compute**: each kind's executed FLOPs over its op class's measured rate
  (:data:`.profile.OP_CLASS`), plus the op calls of a micro-batch (the profile's count over the
  whole model, times the share of the decoder's layers this rank runs) at the measured fixed
  cost per call, plus the profile's unexplained seconds (``other``) times this rank's share of
  the forward FLOPs they were measured at;
- **the layout's own machinery**: for each of CP, EP and TP the plan uses, the profile's
  measured excess of that dimension at degree 2 (:mod:`.layout_cost`), per micro-batch (times
  the layer share) and per step;
- **communication**: each kind's bytes over the measured link's rate, plus one latency per
  collective: the FSDP kinds' three per unit (the forward's and the backward's all-gather, the
  reduce-scatter), the per-micro-batch kinds' as :func:`_collectives` counts them;
- **optimizer**, with what else the step does once: ``3·G + 2·O`` bytes (:mod:`.timing`) over
  the measured streaming rate, the step's op calls beyond its micro-batches' (clipping, the
  optimizer: the profile's ``step`` less ``m`` times ``microbatch``), the data feed's seconds;
- **ranks sharing a CPU** (the plan's ranks all run on this machine): the step is at least
  every rank's busy seconds over the cores (:meth:`Measured.time_shared`; a rank idling in a
  pipeline bubble leaves its core to another), and nothing overlaps (gloo's collectives and the
  compute share the cores); on a GPU :mod:`.timing`'s overlap rules apply.
"""

from __future__ import annotations

from qwen35_trainer.plan.profile import LAYOUT_DIMENSIONS, OP_CLASS, Profile
from qwen35_trainer.plan.traffic import PER_MICROBATCH

__all__ = ["Measured"]


class Measured:
    """Prices one plan's ranks on ``profile`` (module docstring): ``microbatches`` per step,
    ``layout`` its degrees (the dimensions whose own cost it pays)."""

    def __init__(self, profile: Profile, microbatches: int, layout: dict) -> None:
        self.profile, self.op_class, self.microbatches = profile, OP_CLASS, microbatches
        used = [d for d in LAYOUT_DIMENSIONS if layout.get(d, 1) > 1]
        missing = [d for d in used if d not in profile.layouts]
        if missing:
            raise ValueError(
                f"the profile ({profile.model}) has no measured cost for {missing}: it was "
                "measured for a plan without them; measure it with this plan (--measure)"
            )
        self.layouts = [profile.layouts[d] for d in used]
        self.overlaps = not profile.on_cpu

    def compute(self, work) -> float:
        p = self.profile
        arithmetic = sum(
            flops / p.flops_per_s[self.op_class[kind]] for kind, flops in work.executed().items()
        )
        again = work.recompute
        calls = (p.calls["microbatch"] + again * p.calls["forward"]) * work.layer_share
        other = p.other["seconds"] + again * p.other["forward_seconds"]
        share = sum(work.forward.values()) / p.other["flops"]
        layouts = sum(c["microbatch"] for c in self.layouts) * work.layer_share
        return arithmetic + calls * p.call_s + other * share + layouts

    def link(self, kind: str, n: int, work) -> float:
        link = self.profile.link
        if not n:
            return 0.0
        if link["bytes_per_s"] is None:
            raise ValueError(
                f"the profile ({self.profile.model}) was measured on one device, with no link; "
                f"this plan sends {kind}: measure it on a machine with 2 or more"
            )
        collectives = _collectives(kind, work) * self.microbatches
        if kind not in PER_MICROBATCH:
            collectives = 3 * work.units
        return n / link["bytes_per_s"] + collectives * link["latency_s"]

    def optimizer(self, mem, microbatches: int) -> float:
        p = self.profile
        streamed = (3 * mem.gradients + 2 * mem.optimizer) / p.memory_bytes_per_s
        once = max(p.calls["step"] - microbatches * p.calls["microbatch"], 0.0)
        layouts = sum(c["step"] for c in self.layouts)
        return streamed + once * p.call_s + p.data_s + layouts

    def time_shared(self, busy: dict[int, float], world: int, pp: int) -> float:
        """The shortest step ``world`` ranks sharing this CPU's cores can take: the busy
        seconds of one rank of each pipeline stage (``busy``), times the ranks of a stage, over
        the cores each rank's threads occupy (0 on a GPU: a rank has its own)."""
        p = self.profile
        if not p.on_cpu:
            return 0.0
        return sum(busy.values()) * (world // pp) * p.threads / p.cores


def _collectives(kind: str, work) -> float:
    """The collectives of a per-micro-batch kind in one micro-batch (each pays the link's
    latency): ``d`` directions (forward, backward, the recompute's forward); per MoE layer EP's
    dispatch and combine, each its split sizes then its rows; per full-attention layer CP's K/V
    gather; per layer TP's four (two gathers, two reductions); the tower's one gather; the
    pipeline's send of the activations and of their gradient."""
    d = 2 + work.recompute
    return {
        "ep_all_to_all": 4 * work.layers * d,
        "cp_exchange": work.full_layers * d,
        "tp": 4 * work.layers * d,
        "vision_gather": 2,
        "pp_p2p": 2,
    }.get(kind, 0)
