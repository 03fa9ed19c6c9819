"""The held-out evaluation: the global loss and next-token accuracy over ``train.eval_steps``
held-out global batches, split over the ranks as training is (the batches always come from
:meth:`qwen35_trainer.data.feed.Feed.eval_batches`, for both streams). Each rank adds its
tokens' shares of the loss (normalised by the global valid-label count, as in training) and its
correct labels; one all-reduce over the loss group makes them global."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from qwen35_trainer.parallel import Layout
from qwen35_trainer.train.step import all_reduce_loss_group, count_valid

__all__ = ["EvalResult", "evaluate"]


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """The held-out loss (CE + aux_coef * aux) and next-token accuracy over its labels."""

    loss: float
    accuracy: float


@torch.no_grad()
def evaluate(
    recipe: Any, objective, layout: Layout, batches, *, aux_coef: float, device: torch.device
) -> EvalResult:
    """The global loss and accuracy over ``train.eval_steps`` held-out global batches, split
    over the ranks as training is: ``batches(e)`` gives held-out step ``e``'s micro-batches
    (:meth:`qwen35_trainer.data.feed.Feed.eval_batches`)."""
    sums = torch.zeros(3, device=device, dtype=torch.float64)  # ce, aux, correct shares
    labels = 0  # valid labels, global
    for e in range(recipe.train.eval_steps):
        micro = batches(e)
        num_valid = count_valid(micro, layout, device)
        labels += num_valid
        for batch, packed in micro:
            shares = objective(
                batch, layout.loss_group, packed, num_valid_tokens=num_valid, accuracy=True
            )
            sums += torch.stack([shares.ce, shares.aux / len(micro), shares.correct]).double()
    sums = all_reduce_loss_group(
        sums, layout
    )  # each rank counted its own tokens: the sum is global
    steps = recipe.train.eval_steps
    return EvalResult(
        loss=float(sums[0] / steps + aux_coef * sums[1] / steps),
        accuracy=float(sums[2] / labels) if labels else 0.0,
    )
