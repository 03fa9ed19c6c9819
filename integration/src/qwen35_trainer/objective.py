"""The training objective: next-token cross-entropy plus the router load-balancing loss.

Both are returned as this rank's SHARE of the global-batch loss, so that the shares summed over
the data-parallel ranks are exactly the loss of one process on the whole global batch, and so
are their gradients:

- cross-entropy: the sum over this rank's valid (shifted) labels divided by the number of
  valid labels in the GLOBAL batch (:func:`chunked_loss.global_num_valid_tokens`), computed by
  :func:`chunked_loss.linear_cross_entropy` from the final hidden states and ``lm_head`` without
  [tokens, vocab] logits;
- aux loss: transformers' ``load_balancing_loss_func`` over every MoE layer's router logits of
  the non-padding tokens (layers concatenated, as transformers does), as this rank's share
  (:func:`moe_parallel.load_balancing_loss` with the data-parallel group).

The model and the loss run in ONE ``forward`` so that FSDP's root-unit hooks also gather the
``lm_head`` and embedding weights the loss and the model read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from chunked_loss import global_num_valid_tokens, linear_cross_entropy
from moe_parallel import load_balancing_loss
from qwen35_trainer.data import IGNORE_INDEX, Batch
from qwen35_trainer.model import moe_blocks
from qwen35_trainer.packing import PackedInputs, packed_hidden_states

__all__ = ["LossShares", "TrainingObjective"]


@dataclasses.dataclass
class LossShares:
    """This rank's shares (scalars, fp32): the step's loss is ``ce + aux_coef * aux`` summed
    over ranks."""

    ce: torch.Tensor
    aux: torch.Tensor
    tokens: int  # valid labels in the global batch


class TrainingObjective(nn.Module):
    """Wraps a Qwen3.5 MoE-VLM (MoE blocks swapped, see :mod:`qwen35_trainer.model`)."""

    def __init__(self, model: nn.Module, *, loss_chunk_size: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_chunk_size = loss_chunk_size
        self._no_split_modules = list(model._no_split_modules)
        if not moe_blocks(model):
            raise ValueError("TrainingObjective needs the MoE blocks swapped (swap_moe_blocks)")

    def forward(
        self, batch: Batch, group: Any = None, packed: PackedInputs | None = None
    ) -> LossShares:
        """``group``: every rank holding other tokens of the global batch (``None`` for one
        process); the valid labels are counted over it (one all-reduce). ``packed``: the
        row's positions and layout when ``batch`` is one packed row (the model adapted with
        :func:`qwen35_trainer.packing.enable_packing`); ``None`` for right-padded rows."""
        if packed is None:
            outputs = self.model.model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                mm_token_type_ids=batch.mm_token_type_ids,
                pixel_values=batch.pixel_values,
                image_grid_thw=batch.image_grid_thw,
                use_cache=False,
            )
            hidden_BSH = outputs.last_hidden_state[:, :-1]
            labels_BS, tokens_BS = shifted_labels(batch), batch.attention_mask
        else:
            hidden_BSH, labels_BS, tokens_BS = packed_hidden_states(self.model.model, batch, packed)
        if group is None:  # one process, or TP peers only: nothing to sum over
            num_valid_tokens = int((labels_BS != IGNORE_INDEX).sum())
        else:
            num_valid_tokens = global_num_valid_tokens(labels_BS, group=group)
        head = self.model.lm_head
        ce = linear_cross_entropy(
            hidden_BSH,
            head.weight,
            labels_BS,
            bias=head.bias,
            ignore_index=IGNORE_INDEX,
            chunk_size=self.loss_chunk_size,
            num_valid_tokens=num_valid_tokens,
        )
        tokens = tokens_BS.reshape(-1).bool()
        logits = torch.cat([block.stats.router_logits[tokens] for block in moe_blocks(self.model)])
        aux = load_balancing_loss(logits, moe_blocks(self.model)[0].top_k, group=group)
        return LossShares(ce=ce, aux=aux, tokens=num_valid_tokens)


def shifted_labels(batch: Batch) -> torch.Tensor:
    """[B, S-1]: position ``s`` predicts token ``s + 1``."""
    return batch.labels[:, 1:]
