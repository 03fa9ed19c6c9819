"""The training objective of every layout without pipeline stages: the model's forward and the
loss (:mod:`qwen35_trainer.model.loss`, the one description of the loss and of how it is
normalised across layouts), as this rank's SHARES.

The aux loss here is transformers' ``load_balancing_loss_func`` over every MoE layer's router
logits of the non-padding tokens (layers concatenated, as transformers does), as this rank's
share (:func:`moe_parallel.load_balancing_loss` with the loss group).

Ranks whose rows hold no image run the vision tower on a dummy frame (before the decoder, where
the other ranks run it) and add 0 × its output, so FSDP's all-gathers and reduce-scatters of the
vision blocks come in the same order on every rank (a rank that skips a module, or runs it at
another point, hangs its peers or leaves them without its gradients) and the result is
unchanged.

The model and the loss run in ONE ``forward`` so that FSDP's root-unit hooks also gather the
``lm_head`` and embedding weights the loss and the model read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from chunked_loss import global_num_valid_tokens
from moe_parallel import MoE, load_balancing_loss
from qwen35_trainer.data import IGNORE_INDEX, Batch
from qwen35_trainer.data.packing import PackedInputs
from qwen35_trainer.model.build import moe_blocks
from qwen35_trainer.model.loss import head_losses
from qwen35_trainer.model.packed import dummy_vision, packed_hidden_states
from qwen35_trainer.parallel.sequence_parallel import SequenceParallelGrads

__all__ = [
    "LossShares",
    "RouterLogits",
    "TrainingObjective",
    "shifted_labels",
    "valued_as_summed",
]


class LossShares(NamedTuple):
    """This rank's shares (fp32): the step's loss is ``ce + aux_coef * aux + mtp_weight *
    mean(mtp)`` summed over ranks (:func:`qwen35_trainer.model.loss.total_loss`; ``mtp``: each
    depth's MTP cross-entropy share, [D]; ``None`` without the head).

    A tuple, so that a sharding backend's hooks on the objective's output find its tensors:
    megatron-fsdp starts its backward bookkeeping (which parameters' gradients a backward
    reduces) from a hook on a module's output tensors, and it looks inside tuples only."""

    ce: torch.Tensor
    aux: torch.Tensor
    tokens: int  # valid labels in the global batch
    correct: torch.Tensor | None = None  # this rank's labels predicted right (with accuracy)
    mtp: torch.Tensor | None = None
    mtp_correct: torch.Tensor | None = None  # depth 1's targets (token t + 2) predicted right


class RouterLogits:
    """The MoE blocks' router logits of the last forward, in layer order: one collector built
    once (the blocks are found when the objective is made, not by walking the module tree each
    step)."""

    def __init__(self, blocks: list[MoE]) -> None:
        if not blocks:
            raise ValueError("TrainingObjective needs the MoE blocks swapped (swap_moe_blocks)")
        self.blocks = tuple(blocks)
        self.top_k = blocks[0].top_k
        # under sequence parallelism (set by qwen35_trainer.parallel.apply_parallelism): the TP
        # group over which each block routed 1/tp of the tokens, and the group of every rank
        # routing different tokens (loss group x TP)
        self.sequence_group: Any = None
        self.aux_group: Any = None

    def of_tokens(self, tokens_N: torch.Tensor) -> torch.Tensor:
        """[layers * tokens, E]: every layer's logits of the tokens where ``tokens_N`` is set."""
        return torch.cat([block.stats.router_logits[tokens_N] for block in self.blocks])

    def aux_share(self, tokens_N: torch.Tensor, group: Any) -> torch.Tensor:
        """This rank's share of the load-balancing loss of the routed tokens where ``tokens_N``
        (this rank's, [N]) is set; ``group``: the ranks holding other tokens.

        Under SP each TP peer routed its slice of the ``N`` tokens: its share is computed on the
        slice with the counts summed over every rank routing different tokens, so each peer's
        gradient is its logits' part of the global loss's (the rule of
        :func:`moe_parallel.load_balancing_loss`); its VALUE is the TP peers' shares summed
        (the whole rows' share, as without SP), so the loss group's totals are unchanged."""
        if self.sequence_group is None:
            return load_balancing_loss(self.of_tokens(tokens_N), self.top_k, group=group)
        tp = torch.distributed.get_world_size(self.sequence_group)
        mine = tokens_N.chunk(tp)[torch.distributed.get_rank(self.sequence_group)]
        local = load_balancing_loss(self.of_tokens(mine), self.top_k, group=self.aux_group)
        return valued_as_summed(local, self.sequence_group)

    def clear(self) -> None:
        """Drop the last forward's statistics: their logits hold that forward's autograd graph,
        and through it the model."""
        for block in self.blocks:
            block.stats = None

    def tokens_per_expert(self) -> torch.Tensor:
        """[layers, E] the top-k assignments of this rank's tokens in the last forward (under
        SP: summed over the TP peers, which routed different slices of them)."""
        counts = torch.stack([block.stats.tokens_per_expert for block in self.blocks])
        if self.sequence_group is not None:
            torch.distributed.all_reduce(counts, group=self.sequence_group)
        return counts


class TrainingObjective(nn.Module):
    """Wraps a Qwen3.5 MoE-VLM (MoE blocks swapped, see :mod:`qwen35_trainer.model`) and, when
    it has one, its multi-token-prediction head ``model.mtp`` (:mod:`qwen35_trainer.model.
    mtp`; packed rows only). The aux loss and the router statistics are the decoder's MoE
    layers' (as transformers defines them), not the MTP head's."""

    def __init__(self, model: nn.Module, *, loss_chunk_size: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_chunk_size = loss_chunk_size
        self.router = RouterLogits(moe_blocks(model.model))
        self.mtp_depth = len(model.mtp.layers) if hasattr(model, "mtp") else 0
        # under sequence parallelism: the gradients the step sums over TP (set by
        # qwen35_trainer.parallel.apply_parallelism)
        self.sequence_parallel: SequenceParallelGrads | None = None
        # under parallel.fsdp_backend=megatron: megatron-fsdp's wrapper around this objective
        # (set by qwen35_trainer.parallel.megatron.shard_megatron)
        self.megatron: nn.Module | None = None
        # under parallel.pp > 1: this rank's stages and torch's schedule (set by
        # qwen35_trainer.parallel.pipeline.build_pipeline; the step runs them)
        self.pipeline: Any = None

    def forward(
        self,
        batch: Batch,
        group: Any = None,
        packed: PackedInputs | None = None,
        *,
        num_valid_tokens: int | None = None,
        num_valid_mtp: tuple[int, ...] | None = None,
        accuracy: bool = False,
    ) -> LossShares:
        """``group``: every rank holding other tokens of the global batch (``None`` for one
        process); the aux statistics (and, unless ``num_valid_tokens`` is given, the valid
        labels) are summed over it. ``packed``: the row's positions and layout when ``batch``
        is one packed row (the model adapted with :func:`qwen35_trainer.packing.enable_packing`);
        ``None`` for right-padded rows. ``num_valid_tokens`` / ``num_valid_mtp``: the step's
        global valid-label count / each MTP depth's valid-target count when the caller counted
        them (over all micro-batches)."""
        vlm = self.model.model
        if self.mtp_depth and packed is None:
            raise ValueError(
                "the multi-token-prediction head (model.mtp_layers > 0) trains on packed rows "
                "(data.packing: true)"
            )
        # before the decoder, where ranks with images run the tower: FSDP's collectives then
        # come in the same order on every rank
        dummy = None if batch.has_media else dummy_vision(vlm)
        if packed is None:
            if batch.pixel_values_videos.numel():
                raise ValueError(
                    "videos need data.packing: true (the packed forward encodes "
                    "images and videos in one vision call on every rank)"
                )
            outputs = vlm(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                mm_token_type_ids=batch.mm_token_type_ids,
                pixel_values=batch.pixel_values if batch.pixel_values.numel() else None,
                image_grid_thw=batch.image_grid_thw if batch.pixel_values.numel() else None,
                use_cache=False,
            )
            hidden_BSH = outputs.last_hidden_state[:, :-1]
            labels_BS, tokens_BS = shifted_labels(batch), batch.attention_mask
        else:
            hidden_BSH, labels_BS, tokens_BS, embeds_BSH = packed_hidden_states(vlm, batch, packed)
        if num_valid_tokens is None:
            num_valid_tokens = count_valid_labels(labels_BS, group)
        mtp = None
        if self.mtp_depth:
            counts = num_valid_mtp or (None,) * self.mtp_depth
            mtp = (
                self.model.mtp,
                vlm.language_model,
                (embeds_BSH, batch.labels, packed, counts, group),
            )
        ce, correct, mtp_out = head_losses(
            self.model.lm_head,
            hidden_BSH,
            labels_BS,
            num_valid=num_valid_tokens,
            chunk_size=self.loss_chunk_size,
            accuracy=accuracy,
            mtp=mtp,
        )
        if dummy is not None:
            ce = ce + 0.0 * dummy.sum().float()
        return LossShares(
            ce=ce,
            aux=self.router.aux_share(tokens_BS.reshape(-1).bool(), group),
            tokens=num_valid_tokens,
            correct=correct,
            mtp=None if mtp_out is None else mtp_out.ce,
            mtp_correct=None if mtp_out is None else mtp_out.correct,
        )


def valued_as_summed(local: torch.Tensor, group: Any) -> torch.Tensor:
    """``local`` with its VALUE summed over ``group`` and its gradient its own: under SP each TP
    rank's aux share is of its slice of the tokens, and the loss group's logged totals must be
    the whole rows' (:meth:`RouterLogits.aux_share`)."""
    whole = local.detach().clone()
    torch.distributed.all_reduce(whole, group=group)
    return local + (whole - local.detach())


def count_valid_labels(labels: torch.Tensor, group: Any = None) -> int:
    """Valid labels of ``labels`` summed over ``group`` (one all-reduce; ``None``: local)."""
    if group is None:
        return int((labels != IGNORE_INDEX).sum())
    return global_num_valid_tokens(labels, group=group)


def shifted_labels(batch: Batch) -> torch.Tensor:
    """[B, S-1]: position ``s`` predicts token ``s + 1``."""
    return batch.labels[:, 1:]
