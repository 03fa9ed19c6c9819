"""The training loss, described once for every path that computes it: the one-process step and
every layout without pipeline stages (:class:`~qwen35_trainer.model.objective.TrainingObjective`),
the last pipeline stage (:func:`~qwen35_trainer.model.pipeline.ends.stage_loss`), the held-out
evaluation and ``replay`` (through those two).

What a rank computes is its SHARE of the step's loss, so that the shares summed over every rank
holding other tokens and every micro-batch of the step are the loss of one process on the whole
global batch, and so are their gradients (every gradient reduction is a SUM,
:mod:`qwen35_trainer.parallel.apply`):

- cross-entropy (:func:`head_losses`): the sum over this rank's valid (shifted) labels divided by
  the step's GLOBAL valid-label count (every micro-batch, every rank holding other tokens),
  computed by :func:`chunked_loss.linear_cross_entropy` from the final hidden states and
  ``lm_head`` without [tokens, vocab] logits;
- the multi-token-prediction head's depths (:func:`qwen35_trainer.model.mtp.mtp_shares`): each
  depth's cross-entropy the same way, with that depth's own global count of valid targets;
- the router's load-balancing loss (the caller's: the objective's router logits, or the
  statistics the pipeline stages carried): transformers' loss over every MoE layer, a product
  of two batch means and so per micro-batch, each micro-batch's divided by their number;
- the loss a step minimises (:func:`total_loss`): ``ce + aux_coef * aux + mtp_weight *
  mean(mtp)`` (Megatron's scaling of the MTP depths).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from chunked_loss import linear_cross_entropy
from qwen35_trainer.data import IGNORE_INDEX
from qwen35_trainer.model.accuracy import ACCURACY_CHUNK, count_correct
from qwen35_trainer.model.mtp import MtpShares, mtp_shares

__all__ = ["HeadLosses", "HeadWeights", "head_losses", "head_weights", "total_loss"]


class HeadWeights(NamedTuple):
    """``lm_head``'s weight and bias as the loss reads them."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def head_weights(lm_head: torch.nn.Linear, dtype: torch.dtype) -> HeadWeights:
    """``lm_head``'s weight and bias in the compute ``dtype``. The loss reads them outside the
    head's forward, so no FSDP unit of its own could cast them: under FSDP the root unit does
    (and this changes nothing); one LoRA process training ``lm_head`` in full (no FSDP) casts
    them here, differentiably."""
    weight, bias = lm_head.weight, lm_head.bias
    if weight.dtype == dtype:
        return HeadWeights(weight, bias)
    return HeadWeights(weight.to(dtype), None if bias is None else bias.to(dtype))


class HeadLosses(NamedTuple):
    """This rank's cross-entropy share, its labels predicted right (``accuracy``; else
    ``None``) and the MTP head's shares (``None`` without the head)."""

    ce: torch.Tensor
    correct: torch.Tensor | None
    mtp: MtpShares | None


def head_losses(
    lm_head: nn.Linear,
    hidden_BSH: torch.Tensor,
    labels_BS: torch.Tensor,
    *,
    num_valid: int,
    chunk_size: int | None,
    accuracy: bool = False,
    grad_in_forward: bool | None = None,
    mtp: tuple[nn.Module, nn.Module, Any] | None = None,
) -> HeadLosses:
    """The shares the final hidden states ``hidden_BSH`` give against ``labels_BS`` (this
    rank's tokens, the labels already shifted; module docstring). ``num_valid``: the step's
    global valid-label count; ``chunk_size``: the loss's (and accuracy's) tokens per chunk;
    ``grad_in_forward``: :func:`chunked_loss.linear_cross_entropy`'s. ``mtp``: with the
    multi-token-prediction head, ``(head, text model, (embeds_BSH, labels, packed, counts,
    loss group))`` as :func:`~qwen35_trainer.model.mtp.mtp_shares` reads them."""
    head = head_weights(lm_head, hidden_BSH.dtype)
    ce = linear_cross_entropy(
        hidden_BSH,
        head.weight,
        labels_BS,
        bias=head.bias,
        ignore_index=IGNORE_INDEX,
        chunk_size=chunk_size,
        num_valid_tokens=num_valid,
        grad_in_forward=grad_in_forward,
    )
    chunk = (chunk_size or ACCURACY_CHUNK) if accuracy else None
    correct = None
    if accuracy:
        correct = count_correct(hidden_BSH, head.weight, head.bias, labels_BS, chunk)
    shares = None
    if mtp is not None:
        module, text_model, (embeds_BSH, labels, packed, counts, group) = mtp
        shares = mtp_shares(
            module,
            text_model,
            head,
            hidden_BSH,
            embeds_BSH,
            labels,
            packed,
            counts,
            loss_group=group,
            chunk_size=chunk_size,
            accuracy_chunk=chunk,
        )
    return HeadLosses(ce, correct, shares)


def total_loss(ce, aux, mtp, aux_coef: float, mtp_weight: float):
    """The loss a step minimises: ``ce + aux_coef * aux`` plus ``mtp_weight`` times the mean of
    the MTP depths' cross-entropies (Megatron's scaling; ``mtp`` empty or ``None``: no head).
    Floats or tensors (a [D] tensor of MTP shares)."""
    loss = ce + aux_coef * aux
    if mtp is not None and len(mtp):
        loss = loss + mtp_weight * (mtp.mean() if torch.is_tensor(mtp) else sum(mtp) / len(mtp))
    return loss
