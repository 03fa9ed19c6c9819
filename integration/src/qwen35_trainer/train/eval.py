"""The held-out evaluation: the global loss and next-token accuracy over ``train.eval_steps``
held-out global batches, split over the ranks as training is (the batches always come from
:meth:`qwen35_trainer.data.feed.Feed.eval_batches`, for both streams). Each rank adds its
tokens' shares of the loss (normalised by the global valid-label count, as in training) and its
correct labels; one all-reduce over the loss group makes them global. With the
multi-token-prediction head the loss includes its term (as in training, :func:`~qwen35_trainer.
model.loss.total_loss`) and ``mtp_accuracy`` is the head's depth-1 top-1 accuracy on token
``t + 2`` over its valid targets — the quantity that predicts speculative-decoding acceptance.
Under pipeline parallelism the same micro-batches run forward only through torch's schedule
(``eval``), the last stage computing the shares as the one-process objective does."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from qwen35_trainer.model.loss import total_loss
from qwen35_trainer.model.pipeline.stages import StepInputs
from qwen35_trainer.parallel import Layout
from qwen35_trainer.train.step import all_reduce_loss_group, count_targets

__all__ = ["EvalResult", "evaluate"]


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """The held-out loss (:func:`~qwen35_trainer.model.loss.total_loss`), next-token accuracy
    over its labels and, with the MTP head, its depth-1 accuracy (``None`` without)."""

    loss: float
    accuracy: float
    mtp_accuracy: float | None = None


@torch.no_grad()
def evaluate(
    recipe: Any,
    objective,
    layout: Layout,
    batches,
    *,
    aux_coef: float,
    device: torch.device,
    mtp_weight: float = 0.0,
) -> EvalResult:
    """The global loss and accuracy over ``train.eval_steps`` held-out global batches, split
    over the ranks as training is: ``batches(e)`` gives held-out step ``e``'s micro-batches
    (:meth:`qwen35_trainer.data.feed.Feed.eval_batches`). Under pipeline parallelism they run
    forward through the stages (:meth:`qwen35_trainer.model.pipeline.build.Pipeline.evaluate`)
    and the last stage counts; the other stages add zeros to the pipeline group's sums."""
    depth = objective.mtp_depth
    # ce, aux, correct, mtp correct (depth 1), then each depth's MTP cross-entropy: shares
    sums = torch.zeros(4 + depth, device=device, dtype=torch.float64)
    labels = mtp_targets = 0  # valid labels / depth-1 MTP targets, global
    for e in range(recipe.train.eval_steps):
        micro = batches(e)
        num_valid, num_mtp = count_targets(micro, layout, device, depth)
        labels += num_valid
        mtp_targets += num_mtp[0] if depth else 0
        for shares in _shares(objective, micro, layout, num_valid, num_mtp):
            mtp_correct = shares.mtp_correct if depth else torch.zeros((), device=device)
            head = torch.stack([shares.ce, shares.aux, shares.correct, mtp_correct])
            sums += torch.cat([head, shares.mtp if depth else head[:0]]).double()
    sums = all_reduce_loss_group(sums, layout)  # each rank counted its own tokens: global
    if objective.pipeline is not None:  # the last stage's sums, to every stage
        torch.distributed.all_reduce(sums, group=objective.pipeline.group)
    means = sums / recipe.train.eval_steps
    return EvalResult(
        loss=float(total_loss(means[0], means[1], means[4:], aux_coef, mtp_weight)),
        accuracy=float(sums[2] / labels) if labels else 0.0,
        mtp_accuracy=(float(sums[3] / mtp_targets) if mtp_targets else 0.0) if depth else None,
    )


def _shares(objective, micro: list, layout: Layout, num_valid: int, num_mtp) -> list:
    """Each micro-batch's :class:`~qwen35_trainer.model.objective.LossShares` with its correct
    predictions counted, ``aux`` its share of the step's (divided by the micro-batch count);
    under PP the last stage's (none on the other stages)."""
    pipe = objective.pipeline
    if pipe is not None:
        pipe.evaluate(
            StepInputs(micro, num_valid, num_mtp, _unused_loss, layout.loss_group, accuracy=True)
        )
        return list(pipe.last.shares) if pipe.last is not None else []
    out = []
    for batch, packed in micro:
        shares = objective(
            batch,
            layout.loss_group,
            packed,
            num_valid_tokens=num_valid,
            num_valid_mtp=num_mtp,
            accuracy=True,
        )
        out.append(shares._replace(aux=shares.aux / len(micro)))
    return out


def _unused_loss(ce, aux, mtp):
    """The last stage's output under evaluation: nothing backpropagates it, the shares are
    read instead."""
    return ce.detach()
