"""The ends of the pipeline: what the first stage adds before its layers (the row embedded,
the vision tower's features in place) and what the last stage computes after them (the final
norm, the cross-entropy through ``lm_head``, the load-balancing loss of every layer, the MTP
head's loss), as :class:`~qwen35_trainer.model.pipeline.stages.StageModule` runs them.

The loss is the one every layout computes (:func:`qwen35_trainer.model.loss.head_losses` and
:func:`~qwen35_trainer.model.loss.total_loss`, with the step's global label counts); what is the
pipeline's own is where it is computed (the last stage) and its aux loss: transformers' over the
router statistics of every layer, which the stages carried forward
(:mod:`qwen35_trainer.model.pipeline.stages`), instead of the objective's router logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cp_varlen_attn import shard_sequence
from cp_varlen_attn.transformers import embed_packed_row
from moe_parallel import balancing_loss_of, sdpa_preserving_context
from qwen35_trainer.data import IGNORE_INDEX
from qwen35_trainer.data.batch import present_media
from qwen35_trainer.model.loss import head_losses
from qwen35_trainer.model.objective import LossShares, valued_as_summed
from qwen35_trainer.model.packed import dummy_vision, image_features

__all__ = ["embed_row", "stage_loss"]


def embed_row(stage: Any, batch: Any, packed: Any, rank: int):
    """The first stage's inputs, ``(hidden, prob_sum, counts, embeds)``: the whole row
    embedded (vision features in place), this rank's tokens of it, empty router statistics,
    and the whole row's embeddings when the last stage's MTP head reads them."""
    vlm = stage.model.model
    row = {"input_ids": batch.input_ids, **present_media(batch)}
    vision = None
    if packed.group is not None:  # frames sharded over the CP ranks
        vision = functools.partial(image_features, vlm, group=packed.group)
    elif stage.tower_checkpoint:  # the model's own tower call (embed_packed_row's default)
        vision = functools.partial(_tower, vlm)
    if stage.tower_checkpoint:
        vision = functools.partial(_checkpointed, vision)
    embeds = embed_packed_row(vlm, row, vision=vision)
    experts = stage.blocks[0][0].num_experts
    prob_sum = torch.zeros(experts, device=embeds.device)
    counts = torch.zeros(experts + 1, device=embeds.device)
    hidden = shard_sequence(embeds, packed.layout, rank, dim=1)
    if not batch.has_media:  # every rank runs the tower (objective.py's reason); adds 0
        hidden = hidden + 0.0 * dummy_vision(vlm).sum().to(hidden.dtype)
    return hidden, prob_sum, counts, embeds if hasattr(stage.model, "mtp") else None


def stage_loss(stage: Any, batch, packed, rank, hidden_BTH, prob_sum, counts, embeds):
    """The last stage's output: the micro-batch's share of the step's loss, [1]; its shares
    (and, evaluating, its correct predictions) appended to ``stage.shares``."""
    step = stage.inputs
    hidden_BTH = stage.norm(hidden_BTH)
    labels = torch.nn.functional.pad(batch.labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    labels_BT = shard_sequence(labels, packed.layout, rank, dim=1)
    mtp = None
    if embeds is not None:
        language_model = stage.model.model.language_model
        mtp = (
            stage.mtp,
            language_model,
            (embeds, batch.labels, packed, step.num_mtp, step.loss_group),
        )
    ce, correct, mtp_out = head_losses(
        stage.lm_head,
        hidden_BTH,
        labels_BT,
        num_valid=step.num_valid,
        chunk_size=stage.loss_chunk_size,
        accuracy=step.accuracy,
        grad_in_forward=False if stage.backward_twice else None,
        mtp=mtp,
    )
    aux = _aux(stage, prob_sum, counts, step.loss_group) / len(step.micro)
    mtp_ce = None if mtp_out is None else mtp_out.ce
    stage.shares.append(
        LossShares(
            ce.detach(),
            aux.detach(),
            step.num_valid,
            correct,
            None if mtp_ce is None else mtp_ce.detach(),
            None if mtp_out is None else mtp_out.correct,
        )
    )
    # [1], not a view of the scalar (FSDP2 refuses a module output that is a view)
    return torch.stack([step.loss_of(ce, aux, mtp_ce)])


def _aux(stage: Any, prob_sum: torch.Tensor, counts: torch.Tensor, loss_group: Any) -> torch.Tensor:
    """This rank's share of the load-balancing loss of every layer. Under sequence
    parallelism each TP rank's statistics are of its slice, counted over every rank routing
    other tokens; its VALUE is the TP ranks' shares summed, so the loss group's totals are
    as without SP, its gradient its own (``RouterLogits.aux_share``'s rule)."""
    if stage.sequence_group is None:
        return balancing_loss_of(prob_sum, counts, group=loss_group)
    local = balancing_loss_of(prob_sum, counts, group=stage.aux_group)
    return valued_as_summed(local, stage.sequence_group)


def _tower(vlm: nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """[media tokens, D]: the tower's merged features, as transformers' model computes them."""
    return torch.cat(vlm.get_image_features(pixels, grid, return_dict=True).pooler_output)


def _checkpointed(vision: Callable, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``vision(pixels, grid)`` checkpointed whole: the forward keeps its input pixels only and
    the backward runs the tower again (its blocks checkpointed inside, as without PP). The
    first stage holds the saved tensors of every micro-batch in flight (up to ``pp`` under
    1F1B), so the tower's per-block inputs are kept for the one micro-batch whose backward
    runs, not for each. The recompute equals the forward: the tower draws no random numbers
    (the RNG state is restored anyway) and the SDPA backend and callable of the forward are
    restored (:func:`moe_parallel.sdpa_preserving_context`); under CP its frame all-gather runs
    again on every CP rank, as each recomputes the same micro-batch."""
    return checkpoint(
        vision,
        pixels,
        grid,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=sdpa_preserving_context,
    )
