"""How long one optimizer step of a plan takes on a GPU (:mod:`.hardware`): step time,
tokens/s/GPU, model TFLOP/s/GPU, MFU, and what each kind of communication leaves exposed.

Per planned rank (its :class:`.work.Work` and its traffic, :mod:`.traffic`):

- **compute**: each kind's executed FLOPs (forward, recompute, backward) over the GPU's dense
  BF16 peak times the efficiency of the kind's op class (:data:`OP_CLASS`, :class:`Efficiency`):
  the decoder's and the tower's projections (``matmul``), the ``lm_head`` (``head``: one GEMM
  as wide as the vocabulary), the routed experts' grouped GEMM (``grouped``), attention cores
  (``attention``), the gated delta rule (``recurrence``);
- **communication**: each kind's bytes over the bandwidth of its group's links — InfiniBand when
  the group spans nodes (:func:`.nodes.crossing_groups`, from the trainer's rank grids),
  NVLink inside one — times the links' efficiency;
- **overlap rules**: FSDP's (and the experts' FSDP) all-gathers and reduce-scatters run on
  their own streams while the units compute: exposed are one unit's share (the first gather
  and the last reduction have nothing to hide behind) and whatever exceeds the step's compute;
  everything else waits on the compute stream and is exposed whole — EP's dispatch and combine
  (the experts need the rows, the next layer the combined output), CP's K/V and vision
  gathers, TP's collectives (unless async TP fuses them into the matmuls: hidden), PP's sends
  (between two stages' compute), HSDP's all-reduce (after the last reduce-scatter, before the
  optimizer);
- **optimizer**: AdamW reads the fp32 weights, gradients and two moments of what trains and
  writes the weights and moments back: ``3·G + 2·O`` bytes of its shards (:mod:`.memory`'s
  gradients ``G`` and optimizer state ``O``) over the HBM bandwidth.

Per rank and micro-batch, ``b_r`` = (compute + exposed per-micro-batch communication) / ``m``.
The step (``m`` micro-batches; under PP ``v`` stages per rank, ``z`` = 3 for zero bubble, else
1): ``m · max_r b_r + (Σ_r b_r − max_r b_r) / (v · z)`` over the pipeline ranks — the bottleneck
rank's micro-batches and the others' fill and drain: with equal ranks this is ``(m + (pp −
1) / (v z)) · b``, the bubble of :func:`.stages.bubble_fraction`; without PP ``m · b``. Then
the slowest rank's exposed FSDP / HSDP traffic and optimizer step.

Model FLOPs (TFLOP/s/GPU, MFU) follow the ``mfu`` convention: three forwards of the model per
token (:func:`.work.step_model_flops`); tokens/s/GPU: the step's tokens over its time and GPUs.
The efficiencies are each GPU's published kernel measurements (:mod:`.kernel_rates`), fitted to no
trainer's run (``docs/scaling.md`` compares with the published runs, :mod:`.published`);
``--efficiency NAME=VALUE`` changes them. With a measured :class:`.profile.Profile`
(``--measure`` / ``--profile``), :mod:`.measured_time` prices the same work on the machine it
measured instead; the pipeline and step-level rules above are shared.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from qwen35_trainer.plan.flags import named_values
from qwen35_trainer.plan.hardware import Hardware
from qwen35_trainer.plan.kernel_rates import published_efficiencies
from qwen35_trainer.plan.nodes import crossing_groups
from qwen35_trainer.plan.profile import OP_CLASS, Profile
from qwen35_trainer.plan.traffic import PER_MICROBATCH

if TYPE_CHECKING:
    from qwen35_trainer.plan.planner import Plan

__all__ = ["OP_CLASS", "Efficiency", "StepTime", "step_time"]

FSDP_KINDS = (
    "fsdp_all_gather",
    "fsdp_reduce_scatter",
    "expert_fsdp_all_gather",
    "expert_fsdp_reduce_scatter",
)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Achieved over peak, per op class and link (module docstring). The compute classes and
    ``hbm``: the GPU's published kernel measurements (:func:`.kernel_rates.published_efficiencies`,
    :meth:`of`); the links: the share of the datasheet figure NCCL's collectives usually reach
    (stated, not fit)."""

    matmul: float
    head: float
    grouped: float
    attention: float
    recurrence: float
    hbm: float
    nvlink: float = 0.75
    ib: float = 0.85

    @classmethod
    def of(cls, gpu: Hardware) -> Efficiency:
        """``gpu``'s efficiencies from its published kernel measurements."""
        return cls(**published_efficiencies(gpu.key, gpu.bf16_tflops))

    @classmethod
    def parse(cls, items: list[str], gpu: Hardware) -> Efficiency:
        """``NAME=VALUE`` items over ``gpu``'s own (:meth:`of`); ``ValueError`` naming a bad
        one."""
        names = [f.name for f in dataclasses.fields(cls)]
        values = named_values(items, names, "--efficiency", lambda v: 0 < v <= 1, "0 < VALUE <= 1")
        return dataclasses.replace(cls.of(gpu), **values)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One step of a plan on a GPU (module docstring); times in seconds, of the rank that
    decides each (the pipeline's bottleneck, the slowest step-level terms)."""

    gpu: Hardware
    seconds: float
    compute: float  # the bottleneck rank's compute over the step
    exposed: dict[str, float]  # exposed communication per kind (each kind's slowest rank)
    pipeline_idle: float  # the bottleneck rank's share of fill and drain (0 without PP)
    optimizer: float
    tokens: int
    model_flops: float
    world: int
    profile: Profile | None = None  # the measured machine, instead of ``gpu``

    @property
    def tokens_per_gpu(self) -> float:
        return self.tokens / self.seconds / self.world

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.seconds / self.world / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu / self.gpu.bf16_tflops


def _exposed(seconds: dict[str, float], compute: float, units: int, async_tp: bool):
    """Each kind's exposed seconds under the overlap rules (module docstring)."""
    fsdp = sum(seconds.get(k, 0.0) for k in FSDP_KINDS)
    hidden_fsdp = 1.0
    if fsdp > 0:
        hidden_fsdp = (fsdp / units + max(fsdp - compute, 0.0)) / fsdp
    exposed = {}
    for kind, s in seconds.items():
        if kind in FSDP_KINDS:
            exposed[kind] = s * min(hidden_fsdp, 1.0)
        elif kind == "tp" and async_tp:
            exposed[kind] = 0.0
        else:
            exposed[kind] = s
    return exposed


class _Datasheet:
    """Prices a rank's work on ``gpu``'s datasheet times ``eff`` (module docstring)."""

    def __init__(self, gpu: Hardware, eff: Efficiency, crossing: set[str]) -> None:
        self.gpu, self.eff, self.crossing = gpu, eff, crossing
        self.overlaps = True

    def compute(self, work) -> float:
        peak = self.gpu.peak_flops
        return sum(
            flops / (peak * getattr(self.eff, OP_CLASS[kind]))
            for kind, flops in work.executed().items()
        )

    def link(self, kind: str, n: int, work) -> float:
        gpu, eff = self.gpu, self.eff
        gbps = gpu.ib_gbps * eff.ib if kind in self.crossing else gpu.nvlink_gbps * eff.nvlink
        return n / (1e9 * gbps)

    def optimizer(self, mem, microbatches: int) -> float:
        return (3 * mem.gradients + 2 * mem.optimizer) / (self.gpu.hbm_tbps * 1e12 * self.eff.hbm)


def step_time(
    plan: Plan,
    gpu: Hardware,
    efficiency: Efficiency | None = None,
    node_gpus: int = 8,
    profile: Profile | None = None,
) -> StepTime:
    """The :class:`StepTime` of ``plan`` on ``gpu`` with ``node_gpus`` GPUs per node, or, with
    a measured ``profile``, on the machine it describes (:mod:`.measured_time`)."""
    step = plan.step
    if step is None or not plan.work:
        raise ValueError("the plan carries no per-rank work to time (plan it with plan())")
    if profile is not None:
        from qwen35_trainer.plan.measured_time import Measured

        prices = Measured(profile, step.microbatches, plan.layout)
    else:
        prices = _Datasheet(
            gpu, efficiency or Efficiency.of(gpu), crossing_groups(step.dims, node_gpus)
        )
    m = step.microbatches
    per_micro, fixed, compute, exposed = {}, {}, {}, {}
    for rank, work in plan.work.items():
        compute[rank] = m * prices.compute(work)
        seconds = {
            kind: prices.link(kind, n, work) for kind, n in plan.rank_traffic.get(rank, {}).items()
        }
        if prices.overlaps:
            exposed[rank] = _exposed(seconds, compute[rank], work.units, step.async_tp)
        else:
            exposed[rank] = seconds
        mem = plan.ranks[rank]
        optimizer = prices.optimizer(mem, m)
        per_micro[rank] = (
            compute[rank] + sum(exposed[rank].get(k, 0.0) for k in PER_MICROBATCH)
        ) / m
        step_level = sum(s for k, s in exposed[rank].items() if k not in PER_MICROBATCH)
        fixed[rank] = (step_level + optimizer, optimizer)
    pp = plan.layout.get("pp", 1)
    per_stage = {}  # the slowest planned rank of each pipeline rank
    for rank, b in per_micro.items():
        key = rank * pp // plan.world
        per_stage[key] = max(per_stage.get(key, 0.0), b)
    bottleneck = max(per_micro, key=per_micro.get)
    slowest = max(per_stage.values())
    z = 3 if step.schedule == "interleaved_zb" else 1
    idle = (sum(per_stage.values()) - slowest) / (step.virtual * z) if pp > 1 else 0.0
    last = max(fixed, key=lambda r: fixed[r][0])
    kinds = {k for e in exposed.values() for k in e}
    seconds = m * slowest + idle + fixed[last][0]
    if profile is not None:  # ranks time-sharing a CPU's cores
        busy = {key: m * b + fixed[last][0] for key, b in per_stage.items()}
        seconds = max(seconds, prices.time_shared(busy, plan.world, pp))
    return StepTime(
        gpu,
        seconds,
        compute[bottleneck],
        {k: max(e.get(k, 0.0) for e in exposed.values()) for k in sorted(kinds)},
        idle,
        fixed[last][1],
        step.tokens,
        step.model_flops,
        plan.world,
        profile,
    )
