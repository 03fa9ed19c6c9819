"""Qwen3.5's multi-token-prediction (MTP) head, ``mtp.*``, and its share of the loss.

The module, as the public checkpoints store it and inference servers (vLLM, SGLang) load it as
the draft model of speculative decoding: ``pre_fc_norm_embedding`` and ``pre_fc_norm_hidden``
(the model's zero-centred RMSNorm), ``fc`` ([H, 2H], no bias), ``layers.{i}`` (full-attention
decoder layers with the model's MoE block; ``mtp_num_hidden_layers`` of them) and ``norm``; the
token embedding and the LM head are the main model's. Depth ``d`` (1-based), position ``t``
(``x``: the row's input embeddings, ``h_0``: the main model's final, normed hidden states)::

    h_d(t) = norm(layers[d-1](fc([norm_e(x(t+d)), norm_h(h_{d-1}(t))])))

and ``lm_head(h_d(t))`` predicts token ``t + 1 + d``. The fc, norms and head are shared by the
depths, each depth has its own layer (the servers' layout).

Why packing and CP cannot leak or lose a token: every CP rank holds the whole packed row (its
input embeddings, labels and layout), so the shift by ``d`` and ``d + 1`` is taken on the WHOLE
row (:func:`shifted`) and only then is this rank's part cut out with the layout
(:func:`cp_varlen_attn.shard_sequence`): the token ``t + d`` of a rank's last local position is
read from the row even when another rank computes it — nothing to exchange. A shifted value whose
position lies in another document (document ids from the layout's ``cu_seqlens``) is replaced by
zeros (embeddings) or ``IGNORE_INDEX`` (targets), so a document's last ``d`` positions read no
token of the next document and have no target; the chat template's masked labels stay masked
(a target is the label at ``t + 1 + d``). Those positions change nothing else: the layer's
attention is the packed varlen attention (causal within each document, so no other position
reads them) and the MTP MoE blocks are not in the load-balancing loss.

Normalisation: each depth's cross-entropy is its rank's sum over valid targets divided by the
GLOBAL count of that depth's valid targets (over every micro-batch and rank, like the main
loss's), through :func:`chunked_loss.linear_cross_entropy` (no [tokens, vocab] logits). Unlike
the main loss it recomputes each chunk's logits in the backward (``grad_in_forward=False``): one
more [chunk, V] matmul per chunk instead of keeping a second fp32 [V, H] head gradient from the
forward to the backward (3.8 GiB per GPU at 397B's V × H).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from chunked_loss import global_num_valid_tokens, linear_cross_entropy
from cp_varlen_attn import shard_sequence
from qwen35_trainer.data import IGNORE_INDEX
from qwen35_trainer.model.accuracy import count_correct

__all__ = [
    "MTP_PREFIX",
    "MtpShares",
    "MultiTokenPredictor",
    "add_mtp",
    "document_ids",
    "mtp_shares",
    "mtp_targets",
    "shifted",
]

MTP_PREFIX = "mtp."


class MultiTokenPredictor(nn.Module):
    """The ``mtp`` module (module docstring), built from the model's text config."""

    def __init__(self, text_config: Any, depth: int) -> None:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer,
            Qwen3_5MoeRMSNorm,
        )

        super().__init__()
        h, eps = text_config.hidden_size, text_config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        # full-attention layers numbered after the decoder's (the servers' numbering); their
        # attention reads the model's own config, so enable_packing's implementation applies
        first = text_config.num_hidden_layers
        config = copy.copy(text_config)
        config.layer_types = [*text_config.layer_types, *["full_attention"] * depth]
        self.layers = nn.ModuleList(Qwen3_5MoeDecoderLayer(config, first + i) for i in range(depth))
        for layer in self.layers:
            layer.self_attn.config = text_config
        self.norm = Qwen3_5MoeRMSNorm(h, eps=eps)

    def forward(
        self,
        index: int,
        hidden_BTH: torch.Tensor,
        next_embeds_BTH: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        **layer_kwargs: Any,
    ) -> torch.Tensor:
        """``h_d`` for depth ``d = index + 1`` from ``h_{d-1}`` and the embeddings of the tokens
        ``t + d`` (module docstring)."""
        x_BT2H = torch.cat(
            [self.pre_fc_norm_embedding(next_embeds_BTH), self.pre_fc_norm_hidden(hidden_BTH)],
            dim=-1,
        )
        out = self.layers[index](
            self.fc(x_BT2H), position_embeddings=position_embeddings, **layer_kwargs
        )
        return self.norm(out)


def add_mtp(model: nn.Module) -> MultiTokenPredictor | None:
    """Give a ``Qwen3_5MoeForConditionalGeneration`` its ``mtp`` module of the text config's
    ``mtp_num_hidden_layers`` layers (none when 0), on the current default device."""
    text = model.config.text_config
    depth = getattr(text, "mtp_num_hidden_layers", 0)
    if not depth:
        return None
    model.mtp = MultiTokenPredictor(text, depth)
    return model.mtp


def document_ids(cu_seqlens: list[int], device: torch.device | str) -> torch.Tensor:
    """[S]: each position's document index in a packed row (``cu_seqlens``: its boundaries)."""
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(cu_seqlens)], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)


def shifted(x_BS: torch.Tensor, by: int, doc_S: torch.Tensor, fill: float | int) -> torch.Tensor:
    """``x`` moved ``by`` positions left along dim 1 (position ``t`` holds ``x[t + by]``), with
    ``fill`` wherever ``t + by`` lies past the row or in another document than ``t``."""
    s = x_BS.shape[1]
    out = torch.full_like(x_BS, fill)
    if by >= s:
        return out
    same_S = doc_S[by:] == doc_S[: s - by]
    mask = same_S.view(1, -1, *[1] * (x_BS.dim() - 2))
    out[:, : s - by] = torch.where(mask, x_BS[:, by:], out[:, : s - by])
    return out


def mtp_targets(labels_BS: torch.Tensor, doc_S: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, S]: position ``t``'s depth-``depth`` target, the label of token ``t + 1 + depth`` of
    its own document (``IGNORE_INDEX`` where there is none)."""
    return shifted(labels_BS, depth + 1, doc_S, IGNORE_INDEX)


@dataclasses.dataclass
class MtpShares:
    """This rank's shares of each depth's MTP cross-entropy ([D], fp32) and, with accuracy, of
    depth 1's correct top-1 predictions (token ``t + 2``)."""

    ce: torch.Tensor
    correct: torch.Tensor | None = None


def mtp_shares(
    mtp: MultiTokenPredictor,
    text_model: nn.Module,
    head: Any,
    hidden_BTH: torch.Tensor,
    embeds_BSH: torch.Tensor,
    labels_BS: torch.Tensor,
    packed: Any,
    counts: tuple[int | None, ...],
    *,
    loss_group: Any = None,
    chunk_size: int | None,
    accuracy_chunk: int | None = None,
) -> MtpShares:
    """Every depth's share on this rank's tokens of one packed row (module docstring).
    ``head``: the LM head's ``weight`` and ``bias`` (``lm_head``, or the objective's
    :class:`~qwen35_trainer.model.loss.HeadWeights`); ``hidden_BTH``: the main model's final hidden states of this rank's tokens; ``embeds_BSH``
    / ``labels_BS``: the whole row's input embeddings and labels (not shifted); ``packed``: its
    :class:`~qwen35_trainer.data.packing.PackedInputs`; ``counts``: each depth's global valid
    targets (``None``: counted here, summed over ``loss_group``, every rank holding other
    tokens); ``accuracy_chunk``: also
    count depth 1's correct predictions, that many tokens at a time."""
    layout, group = packed.layout, packed.group
    rank = dist.get_rank(group) if group is not None else 0
    doc_S = document_ids(layout.cu_seqlens, labels_BS.device)
    positions = shard_sequence(packed.position_ids, layout, rank, dim=2)
    rope = text_model.rotary_emb(hidden_BTH, positions)
    kwargs = {"attention_mask": None, "cp_layout": layout, "cp_group": group}
    ce, correct, h_BTH = [], None, hidden_BTH
    for index, count in enumerate(counts):
        depth = index + 1
        next_BSH = shifted(embeds_BSH, depth, doc_S, 0.0)
        h_BTH = mtp(index, h_BTH, shard_sequence(next_BSH, layout, rank, dim=1), rope, **kwargs)
        targets_BT = shard_sequence(mtp_targets(labels_BS, doc_S, depth), layout, rank, dim=1)
        if count is None:  # each rank counts its own tokens' targets
            count = int((targets_BT != IGNORE_INDEX).sum())
            if loss_group is not None:
                count = global_num_valid_tokens(targets_BT, group=loss_group)
        ce.append(
            linear_cross_entropy(
                h_BTH,
                head.weight,
                targets_BT,
                bias=head.bias,
                ignore_index=IGNORE_INDEX,
                chunk_size=chunk_size,
                num_valid_tokens=count,
                grad_in_forward=False,  # recomputed in backward: no second [V, H] fp32 gradient
            )
        )
        if accuracy_chunk and depth == 1:
            correct = count_correct(h_BTH, head.weight, head.bias, targets_BT, accuracy_chunk)
    return MtpShares(torch.stack(ce).float(), correct)
