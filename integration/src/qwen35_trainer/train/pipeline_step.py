"""One optimizer step under pipeline parallelism (``parallel.pp > 1``): the same step as
:func:`qwen35_trainer.train.step.train_step`, its micro-batches run through torch's schedule.

Why it is the one-process step: the valid labels (and each MTP depth's targets) of EVERY
micro-batch are counted before the schedule runs, over the loss group (every stage rank holds
the same micro-batches, so each stage counts alike), and each micro-batch's loss on the last
stage is its share of the step's loss with those global counts
(:mod:`qwen35_trainer.model.pipeline.stages`); torch backpropagates the shares unscaled. The gradient
norm sums the stages' squared norms over the pipeline group (each parameter lives on one
stage; within a stage each mesh counts its shards once), so clipping scales every stage by the
same factor. The logged totals — cross-entropy, aux, MTP, FLOPs — are summed over the loss
group and then the pipeline group (the stages that hold no loss add zeros; the FLOPs are the
whole model's, so each stage adds ``1/pp`` of them), and the router loads are combined over
the stages (the max over every layer's max/mean, the idle experts summed): every rank reports
and decides on the same global numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdp_compat import clip_grad_norm
from qwen35_trainer.model.loss import total_loss
from qwen35_trainer.model.pipeline.stages import StepInputs
from qwen35_trainer.parallel import Layout
from qwen35_trainer.parallel.sequence_parallel import sum_sequence_parallel_grads
from qwen35_trainer.train.step import (
    StepResult,
    all_reduce_loss_group,
    count_targets,
    finish_step,
    micro_flops,
    train_step,
)

__all__ = ["pipeline_step", "step_function"]


def step_function(objective) -> Callable[..., StepResult]:
    """The step a run takes: :func:`pipeline_step` under PP, else :func:`train_step`."""
    return train_step if objective.pipeline is None else pipeline_step


def pipeline_step(
    objective,
    optimizer,
    micro,
    layout: Layout,
    *,
    aux_coef: float,
    grad_clip: float | None,
    device: torch.device,
    mtp_weight: float = 0.0,
    before_clip: Callable[[], None] | None = None,
) -> StepResult:
    """Forward and backward of every micro-batch through this rank's stages, clip, optimizer
    step, zero the gradients (``train_step``'s contract, module docstring)."""
    pipe = objective.pipeline
    num_valid, num_mtp = count_targets(micro, layout, device, objective.mtp_depth)
    loss_of = functools.partial(total_loss, aux_coef=aux_coef, mtp_weight=mtp_weight)
    pipe.run(StepInputs(micro, num_valid, num_mtp, loss_of, layout.loss_group))
    # under SP the whole parameters of the SP regions saw 1/tp of the tokens: sum over TP
    sum_sequence_parallel_grads(objective.sequence_parallel)
    if before_clip is not None:
        before_clip()
    grad_norm = clip_grad_norm(objective.parameters(), grad_clip, across=pipe.group, device=device)
    ce, aux, mtp = _last_stage_sums(pipe.last, objective.mtp_depth, device)
    flops = micro_flops(objective.model.config, micro, layout) / dist.get_world_size(pipe.group)
    totals, applied = finish_step(
        optimizer, grad_norm, ce, aux, mtp, flops, layout, across=pipe.group
    )
    peak, idle = _router_load(pipe, layout, device, objective.router.sequence_group)
    cp_imbalance = max(p.layout.compute_imbalance for _, p in micro)
    return StepResult.of(totals, grad_norm, num_valid, peak, idle, float(cp_imbalance), applied)


def _last_stage_sums(last, depth: int, device: torch.device):
    """This rank's sums of the micro-batches' (ce, aux, mtp [D]) shares: the last stage's, or
    zeros on the other stages."""
    ce = aux = torch.zeros((), device=device)
    mtp = torch.zeros(depth, device=device)
    for shares in last.shares if last is not None else ():
        ce, aux = ce + shares.ce, aux + shares.aux
        if shares.mtp is not None:
            mtp = mtp + shares.mtp
    return ce, aux, mtp


def _router_load(pipe, layout: Layout, device: torch.device, tp_group) -> tuple[float, int]:
    """``(max over every layer of max/mean tokens per expert, experts idle in every layer)``
    of the step, over the loss group (and the TP ranks' slices under SP) and the stages."""
    load = torch.cat([m.load for m in pipe.modules])  # [this rank's layers, E]
    if tp_group is not None:
        dist.all_reduce(load, group=tp_group)
    load = all_reduce_loss_group(load, layout).float()
    mean = load.mean(dim=1).clamp(min=1e-9)
    peak = (load.max(dim=1).values / mean).max().reshape(1).to(device)
    idle = (load == 0).sum().reshape(1).to(device=device, dtype=torch.float32)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=pipe.group)
    dist.all_reduce(idle, group=pipe.group)
    return float(peak), int(idle)
