"""Pipeline parallelism with ``torch.distributed.pipelining``: this rank's stages
(:class:`~qwen35_trainer.model.pipeline.stages.StageModule`), each wrapped by FSDP2 over its stage's
``dp_shard × cp`` ranks as its own root, in torch's ``PipelineStage`` and one of torch's
schedules (no home-made scheduler).

Why the step is the one-process step: every micro-batch's loss on the last stage is its share
of the step's global loss (the global label counts are counted before the schedule runs,
:mod:`qwen35_trainer.train.pipeline_step`), and the schedule backpropagates each share
unscaled (``scale_grads=False``: dividing by the micro-batch count again would normalise twice);
each stage's parameters then hold exactly their part of the one-process gradient, FSDP2 sums
them over the stage's data ranks (SUM reductions, as without PP), and the gradient norm adds
the stages' squared norms over the pipeline group (each parameter lives on one stage).

The P2P buffers' shapes are given to every stage (``input_args`` / ``output_args`` on the meta
device), so no stage runs a probing forward: a micro-batch is one packed row of exactly its
capacity (``data.pack_length`` times the rows per micro-batch, :mod:`qwen35_trainer.data.feed`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from qwen35_trainer.model.flops import layer_costs
from qwen35_trainer.model.pipeline.stages import StageModule, StepInputs, keep_stages
from qwen35_trainer.parallel.pipeline_split import (
    PP_SCHEDULES,
    SPLIT_BACKWARD,
    balanced_split,
    stages_of_rank,
)

__all__ = ["Pipeline", "PipelinePlan", "build_pipeline", "plan_pipeline", "stage_layers"]


@dataclasses.dataclass
class PipelinePlan:
    """What a rank builds: every stage's layers, which stages are this rank's, the schedule,
    the micro-batch row's tokens (``row_tokens``; each CP rank holds ``row_tokens / cp`` of
    them, and under sequence parallelism each of its TP ranks ``1 / tp`` of those between the
    stages: ``split``) and the compute dtype."""

    stage_layers: list[range]
    mine: list[int]
    schedule: str
    microbatches: int
    row_tokens: int
    split: int
    dtype: torch.dtype
    loss_chunk_size: int | None
    mtp: bool  # the whole row's embeddings travel to the last stage
    embeds_train: bool  # the embeddings carry one (the embedding or the tower trains)
    # train.activation_checkpointing: the first stage also checkpoints the vision tower whole
    # (StageModule): its block inputs are then kept for one micro-batch, not each in flight
    tower_checkpoint: bool = False

    @property
    def split_backward(self) -> bool:
        """A zero-bubble schedule: each backward in two passes (``SPLIT_BACKWARD``)."""
        return self.schedule in SPLIT_BACKWARD


@dataclasses.dataclass
class Pipeline:
    """This rank's stage modules (the order of ``plan.mine``), torch's schedule and the
    pipeline group."""

    plan: PipelinePlan
    modules: list[StageModule]
    schedule: Any
    group: Any

    @property
    def last(self) -> StageModule | None:
        """The last stage's module when this rank holds it."""
        return next((m for m in self.modules if m.last), None)

    def run(self, inputs: StepInputs) -> None:
        """Forward and backward of every micro-batch of ``inputs`` through the pipeline."""
        index = self._start(inputs)
        self.schedule.step(index, target=index, losses=[], return_outputs=False)

    @torch.no_grad()
    def evaluate(self, inputs: StepInputs) -> None:
        """The forward of every micro-batch of ``inputs`` through the pipeline, no backward
        (torch's ``eval`` of the same schedule): the last stage's ``shares`` hold each
        micro-batch's loss shares and, with ``inputs.accuracy``, its correct predictions."""
        index = self._start(inputs)
        self.schedule.eval(index, target=index, losses=[])

    def _start(self, inputs: StepInputs) -> torch.Tensor:
        """The stages given ``inputs``; the micro-batch indices the schedule splits."""
        for module in self.modules:
            module.inputs, module.shares, module.load = inputs, [], None
        device = inputs.micro[0][0].input_ids.device
        return torch.arange(len(inputs.micro), device=device).reshape(-1, 1)


def stage_layers(recipe: Any, config: Any) -> list[range]:
    """The decoder layers of each of the ``pp * pp_virtual_stages`` stages, in order."""
    p = recipe.parallel
    counts = p.pp_layers
    if counts is None:
        costs, first, last = layer_costs(config, recipe.data.pack_length)
        counts = balanced_split(costs, p.pp * p.pp_virtual_stages, first, last)
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def plan_pipeline(recipe: Any, objective: nn.Module, pp_rank: int) -> Callable[..., Pipeline]:
    """The model keeps only pipeline rank ``pp_rank``'s stages' modules
    (:func:`~qwen35_trainer.model.pipeline.stages.keep_stages`); returns ``build(shard, pp_mesh,
    device)``, :func:`build_pipeline` of its plan (called by :func:`qwen35_trainer.parallel.
    apply_parallelism` once the other parallelisms are applied)."""
    p, model = recipe.parallel, objective.model
    layers = stage_layers(recipe, model.config)
    mine = stages_of_rank(pp_rank, p.pp, p.pp_virtual_stages)
    # read on the whole model, before this rank drops the others' stages: alike on every rank
    trains = {n: p.requires_grad for n, p in model.named_parameters()}
    embeds = any(
        g
        for n, g in trains.items()
        if n.startswith(("model.visual.", "model.language_model.embed"))
    )
    keep_stages(model, layers, mine, p.pp)
    data, per_micro = recipe.data, recipe.data.pack_length
    if data.dataset:  # a dataset micro-batch packs its rows as one (data/feed.py)
        groups = p.dp_replicate * p.dp
        per_micro *= data.rows_per_step(groups) // groups // recipe.train.grad_accum_steps
    plan = PipelinePlan(
        stage_layers=layers,
        mine=mine,
        schedule=p.pp_schedule,
        microbatches=recipe.train.grad_accum_steps,
        row_tokens=per_micro,
        split=p.cp * (p.tp if p.sp else 1),
        dtype=torch.bfloat16 if recipe.train.dtype == "bfloat16" else torch.float32,
        loss_chunk_size=recipe.train.loss_chunk_size,
        mtp=hasattr(model, "mtp"),
        embeds_train=embeds,
        tower_checkpoint=recipe.train.activation_checkpointing,
    )
    return functools.partial(build_pipeline, objective, plan)


def build_pipeline(
    objective: nn.Module, plan: PipelinePlan, shard: Callable, pp_mesh: Any, device: torch.device
) -> Pipeline:
    """This rank's stage modules, each passed to ``shard`` (FSDP2 as its own root), in torch's
    ``PipelineStage`` and the plan's schedule over the ``pp_mesh`` group."""
    from torch.distributed import pipelining

    model, count = objective.model, len(plan.stage_layers)
    modules = [
        StageModule(
            model,
            s,
            count,
            plan.stage_layers[s],
            loss_chunk_size=plan.loss_chunk_size,
            row_tokens=plan.row_tokens,
            split=plan.split,
            tower_checkpoint=plan.tower_checkpoint,
            backward_twice=plan.split_backward,
        )
        for s in plan.mine
    ]
    group = pp_mesh.get_group()
    stages = []
    for module in modules:
        module.sequence_group = objective.router.sequence_group
        module.aux_group = objective.router.aux_group
        # split backward: the units stay unsharded from the forward to the weights' pass
        shard(module, **({"reshard_after_forward": False} if plan.split_backward else {}))
        stages.append(
            pipelining.PipelineStage(
                module,
                module.index,
                count,
                device,
                group=group,
                **_buffers(module, model, plan),
            )
        )
    name, kind = PP_SCHEDULES[plan.schedule]
    schedule_class = getattr(pipelining, name)
    common = {"loss_fn": _loss_is_output, "scale_grads": False}
    if kind == "single":
        schedule = schedule_class(stages[0], plan.microbatches, **common)
    else:
        schedule = schedule_class(stages, plan.microbatches, **common)
    return Pipeline(plan, modules, schedule, group)


def _loss_is_output(output_1: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage's output IS the micro-batch's loss share, [1] (its labels are read by
    the stage itself, from the micro-batch's row)."""
    return output_1.sum()


def _buffers(module: StageModule, model: nn.Module, plan: PipelinePlan) -> dict:
    """The stage's ``input_args`` / ``output_args`` on the meta device (module docstring)."""
    text = model.config.text_config
    hidden, experts = text.hidden_size, text.num_experts
    tokens = plan.row_tokens // plan.split  # this CP rank's (this TP rank's slice under SP)

    def meta(*shape, dtype=plan.dtype, grad=False):
        return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)

    index = meta(1, 1, dtype=torch.long)
    carried = (
        index,
        # every stage has trained parameters (adapters or weights) upstream of its output, and
        # the router statistics are functions of the hidden states (even with frozen routers
        # the aux loss's gradient reaches the earlier stages' parameters through them)
        meta(1, tokens, hidden, grad=True),
        meta(experts, dtype=torch.float32, grad=True),
        meta(experts + 1, dtype=torch.float32),
    )
    if plan.mtp:
        carried = (*carried, meta(1, plan.row_tokens, hidden, grad=plan.embeds_train))
    inputs = (index,) if module.first else carried
    # the last stage's loss as [1]: torch's eval concatenates the micro-batches' outputs
    outputs = meta(1, dtype=torch.float32, grad=True) if module.last else carried
    return {"input_args": inputs, "output_args": outputs}
