"""One optimizer step as a unit a test or a user can drive: given the step's micro-batches
(:mod:`qwen35_trainer.data.feed`), the global valid-label count, forward + backward of every
micro-batch, clipping and the optimizer update, and the step's measurements.

Why the step is the one-process step on the global batch: see :mod:`qwen35_trainer.train.loop`
(shares of one global loss, SUM reductions). The counts here are all global: the valid labels
over every micro-batch and every rank holding different tokens (CP ranks share their rows, so
each counts its whole rows and the sum is divided by ``cp``), the expert loads summed over the
same ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdp_compat import clip_grad_norm
from qwen35_trainer.data import IGNORE_INDEX
from qwen35_trainer.model.flops import training_flops
from qwen35_trainer.parallel import Layout

__all__ = ["StepResult", "all_reduce_loss_group", "count_valid", "micro_flops", "train_step"]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Global numbers of one optimizer step (equal on every rank)."""

    ce: float
    aux: float
    grad_norm: float
    tokens: int
    expert_load_max_over_mean: float
    experts_idle: int
    cp_imbalance: float
    flops: float = 0.0
    applied: bool = True  # False: a non-finite loss or gradient norm, the update not applied


def all_reduce_loss_group(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``t`` summed over the ranks holding different tokens (in place; one process: ``t``)."""
    if layout.loss_group is not None:
        dist.all_reduce(t, group=layout.loss_group)
    return t


def count_valid(micro, layout: Layout, device: torch.device) -> int:
    """The step's valid next-token labels over every micro-batch and every data group."""
    local = sum(int((batch.labels[:, 1:] != IGNORE_INDEX).sum()) for batch, _ in micro)
    return int(all_reduce_loss_group(torch.tensor([local], device=device), layout)) // layout.cp


def micro_flops(config, micro, layout: Layout) -> float:
    """This rank's share of the step's model FLOPs (:func:`qwen35_trainer.model.flops.
    training_flops`): its rows' documents (a packed row's padding run included: it is
    computed) and images; CP ranks share one row, so each counts 1/cp of it."""
    total = 0.0
    for batch, packed in micro:
        if packed is not None:
            cu = packed.layout.cu_seqlens
            docs = [b - a for a, b in itertools.pairwise(cu)]
        else:
            docs = batch.attention_mask.sum(dim=1).tolist()
        total += training_flops(config, docs, batch.image_grid_thw.tolist())
    return total / layout.cp


def train_step(
    objective,
    optimizer,
    micro,
    layout: Layout,
    *,
    aux_coef: float,
    grad_clip: float | None,
    device: torch.device,
    before_clip: Callable[[], None] | None = None,
) -> StepResult:
    """Forward and backward of every micro-batch, clip, optimizer step, zero the gradients.
    The step is not applied (``applied=False``; gradients dropped, optimizer state untouched)
    when the global loss or gradient norm is not finite. ``before_clip``: called (on every
    rank) once the step's gradients are complete, before they are clipped."""
    num_valid = count_valid(micro, layout, device)
    ce = aux = torch.zeros((), device=device)
    load = None
    for batch, packed in micro:
        shares = objective(batch, layout.loss_group, packed, num_valid_tokens=num_valid)
        micro_aux = shares.aux / len(micro)
        (shares.ce + aux_coef * micro_aux).backward()
        ce, aux = ce + shares.ce.detach(), aux + micro_aux.detach()
        counts = torch.stack([b.stats.tokens_per_expert for b in objective.router.blocks])
        load = counts if load is None else load + counts
    if before_clip is not None:
        before_clip()
    grad_norm = clip_grad_norm(objective.parameters(), grad_clip)
    flops = micro_flops(objective.model.config, micro, layout)
    totals = all_reduce_loss_group(
        torch.stack([ce, aux, torch.tensor(flops, device=device)]).double(), layout
    )
    # the norm (over every mesh) and the loss totals are global: every rank decides alike
    applied = math.isfinite(grad_norm) and bool(totals[:2].isfinite().all())
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    load = all_reduce_loss_group(load, layout).float()  # [layers, experts] tokens routed
    mean = load.mean(dim=1).clamp(min=1e-9)
    cp_imbalance = max(p.layout.compute_imbalance for _, p in micro) if micro[0][1] else 1.0
    return StepResult(
        ce=float(totals[0]),
        aux=float(totals[1]),
        grad_norm=grad_norm,
        tokens=num_valid,
        expert_load_max_over_mean=float((load.max(dim=1).values / mean).max()),
        experts_idle=int((load == 0).sum()),
        cp_imbalance=float(cp_imbalance),
        flops=float(totals[2]),
        applied=applied,
    )
