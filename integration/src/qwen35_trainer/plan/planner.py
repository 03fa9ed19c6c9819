"""The dry-run planner: will a recipe fit, before anyone books the GPUs?

On the CPU, for the first and the last rank of the recipe's world (the two ends of every uneven
split; the ranks between hold the same as one of them or less), each in a fresh process (torch
caches meshes per process; :func:`rank_processes`) on a fake process group (:mod:`.world`): the
model is built on the meta device and parallelised by the SAME code the trainer runs
(:func:`qwen35_trainer.parallel.parallelize`: TP, EP, AC, FSDP2 with mixed precision), then
every byte is accounted (:mod:`.memory`), the traffic of one step is
estimated (:func:`.traffic.communication`) and the compute of each planned rank is counted
(:mod:`.work`): :mod:`.timing` prices the plan on a GPU (step time, tokens/s/GPU, MFU).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch

from qwen35_trainer.data.synthetic import max_sample_tokens
from qwen35_trainer.model import build_training_model
from qwen35_trainer.model.build import build_meta_model
from qwen35_trainer.model.config import build_config
from qwen35_trainer.model.fp8.hold import fp8_summary
from qwen35_trainer.model.mtp import MTP_PREFIX
from qwen35_trainer.model.params import named_parameters
from qwen35_trainer.model.whole import whole_parameters
from qwen35_trainer.parallel import FSDP_UNITS, ParallelDims, validate_layout
from qwen35_trainer.plan.dataset_media import micro_rows, planned_images
from qwen35_trainer.plan.headroom import Headroom, process_groups
from qwen35_trainer.plan.memory import ROUTING_SKEW, Memory, Shape, memory
from qwen35_trainer.plan.stages import StageView, bubble_fraction, p2p_bytes, stage_view
from qwen35_trainer.plan.traffic import communication
from qwen35_trainer.plan.work import Work, rank_work, step_model_flops
from qwen35_trainer.plan.world import fake_world
from qwen35_trainer.recipe.dimensions import degrees

__all__ = ["GIB", "Plan", "Step", "communication", "plan", "rank_processes", "row_shape"]

GIB = 1 << 30

# What every planned rank imports (10 s of the 15 s a small plan takes when each rank imports
# it itself), imported once per process by the fork server (:func:`rank_processes`).
PRELOAD = (
    "__main__",  # the start method's own default
    "qwen35_trainer.plan.planner",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)


@dataclasses.dataclass(frozen=True)
class Step:
    """What the step-time model (:mod:`.timing`) needs of the whole step beyond each rank's
    :class:`.work.Work`: the micro-batches and the schedule, the tokens and model FLOPs of the
    step, the layout's rank grids (which groups span nodes) and whether TP's collectives are
    fused into its matmuls (async TP)."""

    microbatches: int
    schedule: str
    virtual: int
    tokens: int
    model_flops: float
    dims: ParallelDims
    async_tp: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    recipe_name: str
    world: int
    layout: dict
    total_parameters: int
    active_parameters: int
    ranks: dict[int, Memory]
    communication: dict[str, int]
    gpu_memory_gib: float
    headroom: Headroom = dataclasses.field(default_factory=Headroom)
    mtp_parameters: int = 0  # of total_parameters: the multi-token-prediction head's
    bubble: float | None = None  # under PP: the share of a step each rank idles
    # each planned rank's traffic (``communication`` is the last planned rank's)
    rank_traffic: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    work: dict[int, Work] = dataclasses.field(default_factory=dict)  # each planned rank's
    step: Step | None = None
    fp8: str | None = None  # a base held in FP8: its modules by kind and bytes (fp8_summary)
    images: str | None = None  # a dataset's run: which images it counts (planned_images)

    def rank_peak(self, rank: int) -> int:
        """``rank``'s predicted peak in bytes: its counted tensors and every headroom term of
        its own transient bytes (:mod:`.headroom`)."""
        return self.ranks[rank].peak + sum(self._terms(self.ranks[rank]).values())

    def _terms(self, m: Memory) -> dict[str, int]:
        dims = ParallelDims(launched=self.world, **self.layout)
        return self.headroom.terms(m.peak - m.parameters - m.optimizer, process_groups(dims))

    @property
    def worst_rank(self) -> int:
        """The planned rank with the largest predicted peak: the verdict is its. Under PP the
        stages differ (the first holds the tower's activations of every micro-batch in flight,
        a middle one the most layers), so its counted and transient bytes are one rank's, not
        the largest of each over different ranks."""
        return max(self.ranks, key=self.rank_peak)

    @property
    def counted_gib(self) -> float:
        """The worst rank's (:attr:`worst_rank`) counted tensors (:mod:`.memory`)."""
        return self.ranks[self.worst_rank].peak / GIB

    @property
    def transient_gib(self) -> float:
        """Of the worst rank's counted peak, what is allocated and freed within a step (all but
        the parameters and the optimizer state)."""
        m = self.ranks[self.worst_rank]
        return (m.peak - m.parameters - m.optimizer) / GIB

    @property
    def headroom_terms(self) -> dict[str, int]:
        """What the worst rank's GPU holds beyond its counted tensors (:mod:`.headroom`), in
        bytes."""
        return self._terms(self.ranks[self.worst_rank])

    @property
    def peak_gib(self) -> float:
        """The predicted peak: the worst rank's counted tensors and every headroom term."""
        return self.rank_peak(self.worst_rank) / GIB

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.gpu_memory_gib

    def to_json(self) -> dict:
        return {
            "recipe": self.recipe_name,
            "world": self.world,
            "layout": self.layout,
            "total_parameters": self.total_parameters,
            "active_parameters": self.active_parameters,
            "mtp_parameters": self.mtp_parameters,
            "ranks": {
                str(r): {
                    **dataclasses.asdict(m),
                    "peak": m.peak,
                    "predicted_peak": self.rank_peak(r),
                }
                for r, m in self.ranks.items()
            },
            "communication_bytes_per_step": self.communication,
            "rank_traffic": {str(r): t for r, t in self.rank_traffic.items()},
            "routing_skew": ROUTING_SKEW,
            "worst_rank": self.worst_rank,
            "counted_peak_gib": self.counted_gib,
            "transient_gib": self.transient_gib,
            "headroom_gib": {k: v / GIB for k, v in self.headroom_terms.items()},
            "predicted_peak_gib": self.peak_gib,
            "pipeline_bubble": self.bubble,
            "gpu_memory_gib": self.gpu_memory_gib,
            "fits": self.fits,
        }


def row_shape(recipe, cp: int, grids=None, work_grids=None) -> Shape:
    """Tokens and patches of the recipe's largest sequence, and this rank's part of it: the
    synthetic stream's row of ``pack_length``, or a dataset's packed rows of one micro-batch
    (``global_batch`` / data-parallel groups / ``grad_accum_steps`` of them, packed as one
    sequence by :func:`qwen35_trainer.data.feed.row_micro_batches`). ``grids``: the patch
    grids ``[t, h, w]`` of one micro-batch's images and videos (:func:`micro_grids`); its
    frames are split evenly over CP; ``work_grids``: those its step time is priced at
    (default: ``grids``)."""
    data, vision = recipe.data, recipe.model.vision
    merge = vision.get("spatial_merge_size", 2) ** 2
    grids = micro_grids(recipe) if grids is None else grids
    patches = sum(t * h * w for t, h, w in grids)
    frames = sum(t for t, _, _ in grids)
    # one micro-batch's samples: the feed splits a rank's step over the micro-batches
    n = max(1, data.samples_per_rank // recipe.train.grad_accum_steps)
    row = data.pack_length or n * max_sample_tokens(recipe.model, data)
    if data.dataset:  # a dataset's rows of one rank and micro-batch run as one sequence
        row *= micro_rows(recipe)
    local_frames = math.ceil(frames / cp)
    return Shape(
        tokens=math.ceil(row / cp) if data.packing else row,
        row_tokens=row,
        image_tokens=patches // merge,
        patches=local_frames * patches // max(frames, 1),
        compute_bytes=2 if recipe.train.dtype == "bfloat16" else 4,
        sequence_split=recipe.parallel.tp if recipe.parallel.sp else 1,
        grids=tuple(tuple(g) for g in grids),
        work_grids=tuple(tuple(g) for g in (grids if work_grids is None else work_grids)),
    )


def micro_grids(recipe) -> list[list[int]]:
    """The synthetic stream's images of one micro-batch, every one of the largest grid of
    ``data.image_grids`` (a dataset's: :mod:`.dataset_media`)."""
    data = recipe.data
    samples = max(1, data.samples_per_rank // recipe.train.grad_accum_steps)
    largest = max(data.image_grids, key=lambda g: g[0] * g[1] * g[2])
    return [list(largest)] * (samples * data.images_per_sample)


def _rank_plan(recipe, dims: ParallelDims, rank: int, grids):
    """``(Memory, (total, routed, MTP) parameters, communication, Work)`` of ``rank``: the model
    built on meta and parallelised on a fake world by the trainer's own code (``dims``: the
    validated layout; ``grids``: one micro-batch's images held and priced, :func:`row_shape`)."""
    world = dims.world
    with fake_world(world, rank):
        objective, _ = build_training_model(
            recipe, torch.device("cpu"), materialize=False, dims=dims
        )
        model = objective.model
        units = [
            m for m in model.modules() if any(c.__name__ in FSDP_UNITS for c in type(m).__mro__)
        ]
        shape = row_shape(recipe, dims.cp, *grids)
        lora = recipe.model.lora is not None
        text = model.config.text_config
        micro = recipe.train.grad_accum_steps
        stage = None
        if objective.pipeline is not None:
            stage = stage_view(objective.pipeline, text.layer_types, micro, dims.pp)
        checkpointing = recipe.train.activation_checkpointing
        mem = memory(
            model,
            dims,
            shape,
            checkpointing=checkpointing,
            units=units,
            sharded=not (lora and world == 1),  # one LoRA process: no FSDP
            stage=stage,
            microbatches=micro,
        )
        counts = parameter_counts(model)
        traffic = communication(
            model,
            dims,
            shape,
            stage and stage.layer_types,
            microbatches=micro,
            checkpointing=checkpointing,
            pipelined=stage is not None,
            tower=stage is None or stage.first,
        )
        if stage is not None:
            traffic["pp_p2p"] = p2p_bytes(
                text,
                stage,
                micro,
                shape.tokens // shape.sequence_split,  # under SP: this TP rank's slice
                shape.row_tokens,
                shape.compute_bytes,
            )
        whole = stage or StageView(tuple(text.layer_types), True, True, 1.0, 0, 0)
        work = rank_work(recipe, model.config, dims, shape, whole, units=len(units))
        return mem, counts, traffic, work


PLAN_PROCESSES = 4  # ranks planned at once (each builds the meta model in its own process)


def parameter_counts(model) -> tuple[int, int, int]:
    """``(total, routed experts, MTP head)`` parameters of ``model`` (DTensors: their global
    sizes)."""
    counts = [0, 0, 0]
    for name, _, _, param in named_parameters(model):
        counts[0] += param.numel()
        counts[1] += param.numel() if "experts." in name else 0
        counts[2] += param.numel() if name.startswith(MTP_PREFIX) else 0
    return counts[0], counts[1], counts[2]


def rank_processes(n: int) -> ProcessPoolExecutor:
    """A pool of ``n`` processes, each running ONE task (a planned rank) and exiting.

    Each is a fresh process with no mesh built, as a rank on its own fake world needs, forked
    from Python's fork server, which imports :data:`PRELOAD` the first time a process plans
    (setting the server's preload list; no effect if the process's fork server already
    runs): later plans skip the import. Where there is no fork server (Windows), each rank is
    spawned and imports everything itself."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
    else:
        context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(n, mp_context=context, max_tasks_per_child=1)


def plan(
    recipe,
    *,
    name: str = "recipe",
    world_size: int | None = None,
    gpu_memory_gib: float = 80.0,
    headroom: Headroom | None = None,
) -> Plan:
    """The :class:`Plan` of ``recipe`` on ``world_size`` ranks (default: what it needs);
    ``ValueError`` with the reasons for a layout that cannot run. ``headroom``: the terms
    beyond the counted tensors (default: :class:`Headroom`'s)."""

    p = recipe.parallel
    if p.fsdp_backend == "megatron":
        raise ValueError(
            "the planner plans parallel.fsdp_backend=fsdp2: it counts FSDP2's shards of a "
            "meta-device model, while megatron-fsdp lays its flat buffers out (and its fp32 main "
            "weights beside bf16 ones) only as it materialises each unit on a real device "
            "(qwen35_trainer.parallel.megatron); plan the same layout with fsdp2"
        )
    world = world_size or p.world
    if world != p.world:
        recipe = dataclasses.replace(recipe, parallel=p.filling(world, "--world-size"))
    dims = validate_layout(recipe, world, on_this_machine=False)
    config = build_config(recipe.model)
    grids, images = planned_images(recipe, config)
    ranks, rank_traffic, work = {}, {}, {}
    # the first and last ranks; under PP the first rank of every stage (each holds other layers)
    planned = sorted({0, world - 1, *range(0, world, world // p.pp)})
    with rank_processes(min(len(planned), PLAN_PROCESSES)) as pool:
        futures = {rank: pool.submit(_rank_plan, recipe, dims, rank, grids) for rank in planned}
        for rank, future in futures.items():
            ranks[rank], (total, routed, mtp), traffic, work[rank] = future.result()
            rank_traffic[rank] = traffic
    if p.pp > 1:  # a planned rank holds its stages only: count the whole model
        total, routed, mtp = parameter_counts(build_meta_model(recipe.model))
    fp8 = None
    if recipe.model.fp8_base:
        fp8 = fp8_summary(whole_parameters(build_meta_model(recipe.model)))
    text = config.text_config
    micro = recipe.train.grad_accum_steps
    shape = row_shape(recipe, p.cp, *grids)
    groups = p.dp_replicate * p.dp
    step = Step(
        micro,
        p.pp_schedule,
        p.pp_virtual_stages if p.pp > 1 else 1,
        shape.row_tokens * micro * groups,
        step_model_flops(recipe, config, shape),
        dims,
        p.async_tp,
    )
    active = total - routed + routed * text.num_experts_per_tok // text.num_experts
    layout = degrees(recipe.parallel)
    return Plan(
        name,
        world,
        layout,
        total,
        active,
        ranks,
        traffic,
        gpu_memory_gib,
        headroom or Headroom(),
        mtp_parameters=mtp,
        bubble=bubble_fraction(p.pp_schedule, p.pp, p.pp_virtual_stages, micro)
        if p.pp > 1
        else None,
        rank_traffic=rank_traffic,
        work=work,
        step=step,
        fp8=fp8,
        images=images,
    )
