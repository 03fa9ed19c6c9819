"""One optimizer step as a unit a test or a user can drive: given the step's micro-batches
(:mod:`qwen35_trainer.data.feed`), the global valid-label count, forward + backward of every
micro-batch, clipping and the optimizer update, and the step's measurements.

Why the step is the one-process step on the global batch: see :mod:`qwen35_trainer.train.loop`
(shares of one global loss, SUM reductions). The counts here are all global: the valid labels
over every micro-batch and every rank holding different tokens (CP ranks share their rows, so
each counts its whole rows and the sum is divided by ``cp``), the expert loads summed over the
same ranks. With the multi-token-prediction head each depth's valid targets are counted the same
way (its own normaliser, :mod:`qwen35_trainer.model.mtp`), and the loss is
:func:`qwen35_trainer.model.loss.total_loss`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist

from fsdp_compat import accumulating, clip_grad_norm, finish_grad_sync
from qwen35_trainer.data import IGNORE_INDEX
from qwen35_trainer.model.flops import training_flops
from qwen35_trainer.model.loss import total_loss
from qwen35_trainer.model.mtp import document_ids, mtp_targets
from qwen35_trainer.parallel import Layout
from qwen35_trainer.parallel.sequence_parallel import sum_sequence_parallel_grads

__all__ = [
    "StepResult",
    "all_reduce_loss_group",
    "count_targets",
    "finish_step",
    "micro_flops",
    "train_step",
]


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
    mtp: tuple[float, ...] = ()  # each MTP depth's cross-entropy (none without the head)

    @classmethod
    def of(cls, totals, grad_norm, tokens, peak, idle, cp_imbalance, applied) -> StepResult:
        """The result of a step whose global ``totals`` are :func:`finish_step`'s."""
        return cls(
            ce=float(totals[0]),
            aux=float(totals[1]),
            grad_norm=grad_norm,
            tokens=tokens,
            expert_load_max_over_mean=peak,
            experts_idle=idle,
            cp_imbalance=cp_imbalance,
            flops=float(totals[2]),
            applied=applied,
            mtp=tuple(float(x) for x in totals[3:]),
        )


def all_reduce_loss_group(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``t`` summed over the ranks holding different tokens (in place; one process: ``t``)."""
    if layout.loss_group is not None:
        dist.all_reduce(t, group=layout.loss_group)
    return t


def count_targets(
    micro, layout: Layout, device: torch.device, mtp_depth: int = 0
) -> tuple[int, tuple[int, ...]]:
    """The step's valid next-token labels and each MTP depth's valid targets
    (:func:`qwen35_trainer.model.mtp.mtp_targets`, packed rows) over every micro-batch and
    every data group: one all-reduce."""
    local = [0] * (1 + mtp_depth)
    for batch, packed in micro:
        local[0] += int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
        if mtp_depth:
            doc_S = document_ids(packed.layout.cu_seqlens, batch.labels.device)
            for depth in range(1, mtp_depth + 1):
                local[depth] += int((mtp_targets(batch.labels, doc_S, depth) != IGNORE_INDEX).sum())
    total = all_reduce_loss_group(torch.tensor(local, device=device), layout) // layout.cp
    return int(total[0]), tuple(int(n) for n in total[1:])


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
    mtp_weight: float = 0.0,
    before_clip: Callable[[], None] | None = None,
) -> StepResult:
    """Forward and backward of every micro-batch, clip, optimizer step, zero the gradients.
    The step is not applied (``applied=False``; gradients dropped, optimizer state untouched)
    when the global loss or gradient norm is not finite. ``before_clip``: called (on every
    rank) once the step's gradients are complete, before they are clipped."""
    num_valid, num_mtp = count_targets(micro, layout, device, objective.mtp_depth)
    ce = aux = torch.zeros((), device=device)
    mtp = torch.zeros(objective.mtp_depth, device=device)
    load = None
    sharded = objective.megatron or objective
    for i, (batch, packed) in enumerate(micro):
        shares = objective(
            batch, layout.loss_group, packed, num_valid_tokens=num_valid, num_valid_mtp=num_mtp
        )
        micro_aux = shares.aux / len(micro)
        # every backward but the last adds to the gradients (megatron-fsdp then sums over the
        # HSDP replicas once, on the last; FSDP2: nothing changes)
        with accumulating(sharded) if i < len(micro) - 1 else nullcontext():
            total_loss(shares.ce, micro_aux, shares.mtp, aux_coef, mtp_weight).backward()
        ce, aux = ce + shares.ce.detach(), aux + micro_aux.detach()
        if shares.mtp is not None:
            mtp = mtp + shares.mtp.detach()
        counts = objective.router.tokens_per_expert()
        load = counts if load is None else load + counts
    # megatron-fsdp: the reduced gradients reach the parameters only here (FSDP2: no-op)
    finish_grad_sync(sharded)
    # under SP the whole parameters of the SP regions saw 1/tp of the tokens: sum over TP
    sum_sequence_parallel_grads(objective.sequence_parallel)
    if before_clip is not None:
        before_clip()
    grad_norm = clip_grad_norm(objective.parameters(), grad_clip)
    flops = micro_flops(objective.model.config, micro, layout)
    totals, applied = finish_step(optimizer, grad_norm, ce, aux, mtp, flops, layout)
    load = all_reduce_loss_group(load, layout).float()  # [layers, experts] tokens routed
    mean = load.mean(dim=1).clamp(min=1e-9)
    cp_imbalance = max(p.layout.compute_imbalance for _, p in micro) if micro[0][1] else 1.0
    return StepResult.of(
        totals,
        grad_norm,
        num_valid,
        float((load.max(dim=1).values / mean).max()),
        int((load == 0).sum()),
        float(cp_imbalance),
        applied,
    )


def finish_step(
    optimizer, grad_norm: float, ce, aux, mtp, flops: float, layout: Layout, across=None
) -> tuple[torch.Tensor, bool]:
    """``(totals, applied)``: this rank's sums ``ce``, ``aux``, ``flops`` and ``mtp`` [D] made
    global (the loss group; ``across``: also the pipeline group, whose other stages add zeros),
    as ``[ce, aux, flops, *mtp]`` fp64; the optimizer step taken only when the gradient norm
    and the global losses are finite (they are global, so every rank decides alike), and the
    gradients zeroed either way."""
    flops_1 = torch.tensor([flops], device=ce.device)
    totals = all_reduce_loss_group(
        torch.cat([ce.reshape(1), aux.reshape(1), flops_1, mtp]).double(), layout
    )
    if across is not None:
        dist.all_reduce(totals, group=across)
    losses = torch.cat([totals[:2], totals[3:]])
    applied = math.isfinite(grad_norm) and bool(losses.isfinite().all())
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return totals, applied
