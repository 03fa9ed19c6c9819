"""Packed training: a rank's samples as ONE sequence, documents kept apart in every layer,
optionally split over context-parallel (CP) ranks.

transformers' Qwen3.5 text model, fed one row that concatenates several documents, would let them
see each other: its attention masks only by position, and its Gated DeltaNet layers carry the
recurrent state (and the conv1d's inputs) across the boundary. Here the model is adapted in
place, without touching its parameters or state dict:

- attention layers use the attention function registered as ``"qwen35_packed"``:
  :func:`cp_varlen_attn.varlen_attention`, causal within each document (block-diagonal), never
  an [S, S] mask;
- every ``linear_attn`` (Gated DeltaNet) runs :func:`cp_varlen_attn.packed_gated_deltanet_forward`,
  which resets the state and the convolution at every document boundary;
- positions are the multimodal RoPE positions of each document computed on its own
  (``get_rope_index``), concatenated, so every document is positioned as if it were alone.

What the layers need (the document layout) travels as keyword arguments of the forward call
(``cp_layout`` / ``cp_group``), which transformers hands down to every layer; activation
checkpointing therefore replays it exactly (no global or context-variable state).

Under CP the row's :class:`cp_varlen_attn.CPLayout` (balanced by default) assigns each rank
pieces of documents; the same layout drives attention (each rank fetches only the K/V it needs)
and the Gated DeltaNet (state summaries flow to the ranks holding later pieces), so a rank's
outputs equal the one-process outputs at its tokens (:func:`packed_hidden_states`). The vision
tower's frames are split over the CP ranks too (:func:`image_features`).

Padding at the end of a packed row is its own "document" (it attends only to itself); its labels
and its router statistics are excluded like any padding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cp_varlen_attn import (
    packed_gated_deltanet_forward,
    plan_cp_layout,
    shard_sequence,
    validate_layout,
    varlen_attention,
)
from cp_vision import run_vision_sharded
from qwen35_trainer.data import IGNORE_INDEX, Batch, Sample, text_vocab

__all__ = [
    "ATTENTION",
    "PackedBatch",
    "PackedInputs",
    "enable_packing",
    "pack",
    "packed_hidden_states",
    "row_layout",
]

ATTENTION = "qwen35_packed"


@dataclasses.dataclass
class PackedInputs:
    """What the packed forward needs besides the batch: per-document M-RoPE ``position_ids``
    [3, 1, S] of the whole row, its ``layout`` over the CP ranks (one rank: ``cp_size`` 1) and
    the CP ``group`` (``None`` without CP)."""

    position_ids: torch.Tensor
    layout: Any
    group: Any = None


@dataclasses.dataclass
class PackedBatch:
    """One packed row: ``batch`` has B = 1; ``cu_seqlens`` [docs + 1] includes a trailing padding
    run; ``position_ids`` [3, 1, S] are per-document M-RoPE positions."""

    batch: Batch
    cu_seqlens: torch.Tensor
    position_ids: torch.Tensor


def _packed_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                      cp_layout=None, cp_group=None, **kwargs):  # fmt: skip
    """transformers attention interface: q [1, H, S, D], k/v [1, H_kv, S, D] → ([1, S, H, D], None)."""
    if cp_layout is None:
        raise ValueError(f"attention {ATTENTION!r} needs cp_layout= in the model call")
    if dropout:
        raise ValueError("packed attention does not implement attention dropout")
    out = varlen_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                           cp_layout, cp_group, causal=True, softmax_scale=scaling)  # fmt: skip
    return out, None


def _packed_gdn(layer, hidden_states, cache=None, attention_mask=None, *, cp_layout=None,
                cp_group=None, **kwargs):  # fmt: skip
    if cp_layout is None:
        raise ValueError("a packed Gated DeltaNet layer needs cp_layout= in the model call")
    if cache is not None:
        raise ValueError("packed training runs without a cache (use_cache=False)")
    return packed_gated_deltanet_forward(layer, hidden_states, layout=cp_layout, group=cp_group)


def enable_packing(model: nn.Module) -> list[str]:
    """Adapt ``model`` (a Qwen3.5 MoE-VLM) in place for packed rows; returns the GDN paths."""
    from transformers import AttentionInterface
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    AttentionInterface.register(ATTENTION, _packed_attention)
    model.config.text_config._attn_implementation = ATTENTION
    patched = []
    for path, module in model.named_modules():
        if isinstance(module, Qwen3_5MoeGatedDeltaNet):
            module.forward = functools.partial(_packed_gdn, module)
            patched.append(path)
    if not patched:
        raise ValueError(f"{type(model).__name__} has no Gated DeltaNet layer to adapt")
    return patched


def pack(samples: list[Sample], model_spec: Any, rope_index, pad_token_id: int,
         multiple: int = 8) -> PackedBatch:  # fmt: skip
    """Concatenate ``samples`` into one row padded to a multiple of ``multiple``.

    ``rope_index``: the model's ``get_rope_index`` (positions of one document).
    """
    vocab = text_vocab(model_spec)
    ids, labels, positions, lengths = [], [], [], []
    for s in samples:
        doc = s.input_ids
        mm = (doc == model_spec.image_token_id).int()
        pos, _ = rope_index(doc[None], mm[None], image_grid_thw=s.image_grid_thw)
        doc_labels = doc.masked_fill(doc >= vocab, IGNORE_INDEX)
        doc_labels[0] = IGNORE_INDEX  # the previous document's last token does not predict it
        ids.append(doc)
        labels.append(doc_labels)
        positions.append(pos)
        lengths.append(doc.numel())
    total = sum(lengths)
    pad = -total % multiple
    if pad:
        ids.append(torch.full((pad,), pad_token_id))
        labels.append(torch.full((pad,), IGNORE_INDEX))
        positions.append(torch.arange(pad).view(1, 1, -1).expand(3, 1, -1))
        lengths.append(pad)
    input_ids = torch.cat(ids).long()[None]
    mask = torch.ones_like(input_ids)
    mask[:, total:] = 0
    batch = Batch(
        input_ids=input_ids,
        attention_mask=mask,
        mm_token_type_ids=(input_ids == model_spec.image_token_id).int(),
        labels=torch.cat(labels)[None],
        pixel_values=torch.cat([s.pixel_values for s in samples]),
        image_grid_thw=torch.cat([s.image_grid_thw for s in samples]),
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedBatch(batch, cu, torch.cat(positions, dim=-1))


def packed_hidden_states(
    vlm: nn.Module, batch: Batch, packed: PackedInputs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This CP rank's final hidden states [1, T, H], next-token labels [1, T] and token mask.

    The row is embedded whole (text embeddings, then the vision tower's features scattered into
    the image placeholders, as transformers' ``Qwen3_5MoeModel.forward`` does), then this rank's
    tokens are taken in layout order (:func:`cp_varlen_attn.shard_sequence`, whose backward puts
    each token's gradient back in place) and run through the language model with the layout.
    Labels are shifted on the whole row first (position ``s`` predicts token ``s + 1``), so a
    token's target is right whichever rank holds it. A feature's gradient comes only from the
    rank holding its placeholder; :func:`image_features` sums those onto the rank that encoded
    the frame, and FSDP sums the tower's gradients over the ranks.
    """
    embeds = vlm.get_input_embeddings()(batch.input_ids)
    if batch.pixel_values is not None and batch.pixel_values.numel():
        image_embeds = image_features(vlm, batch, packed.group).to(embeds.dtype)
        mask, _ = vlm.get_placeholder_mask(
            batch.input_ids, inputs_embeds=embeds, image_features=image_embeds
        )
        embeds = embeds.masked_scatter(mask, image_embeds)
    layout, group = packed.layout, packed.group
    rank = dist.get_rank(group) if group is not None else 0
    # one agreement on the row's layout for the whole step: the CP calls in every layer (and
    # in activation-checkpoint recomputes) then run no validation collective
    validate_layout(layout, group)
    out = vlm.language_model(
        inputs_embeds=shard_sequence(embeds, layout, rank, dim=1),
        position_ids=shard_sequence(packed.position_ids, layout, rank, dim=2),
        # documents are kept apart by the layout, not by masks: no [S, S] mask is built
        attention_mask={"full_attention": None, "linear_attention": None},
        use_cache=False,
        cp_layout=layout,
        cp_group=group,
    )
    next_labels = F.pad(batch.labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return (
        out.last_hidden_state,
        shard_sequence(next_labels, layout, rank, dim=1),
        shard_sequence(batch.attention_mask, layout, rank, dim=1),
    )


def image_features(vlm: nn.Module, batch: Batch, group: Any) -> torch.Tensor:
    """[image tokens, D]: the vision tower's merged features of the row's images, in order.

    Without CP, transformers' ``get_image_features``. Under CP the frames are split over the CP
    ranks by :func:`cp_vision.run_vision_sharded` (each rank encodes a cost-balanced contiguous
    slice; a variable-length all-gather reassembles all features on every rank, its backward sums
    every rank's gradient for a slice onto the rank that encoded it), so the tower's work is not
    replicated. The result equals the unsharded tower's because Qwen3.5's tower attends only
    within a frame and its position embeddings are spatial.
    """
    pixel_values = batch.pixel_values.type(vlm.visual.dtype)
    if group is None:
        out = vlm.get_image_features(pixel_values, batch.image_grid_thw, return_dict=True)
        return torch.cat(out.pooler_output, dim=0)
    tower = vlm.visual
    return run_vision_sharded(
        lambda rows, grid: tower(rows, grid_thw=grid).pooler_output,
        pixel_values,
        batch.image_grid_thw,
        group,
        trainable=any(p.requires_grad for p in tower.parameters()),
    )


def row_layout(row: PackedBatch, cp: int = 1):
    """The layout of a packed row over ``cp`` ranks (balanced; one rank without CP)."""
    return plan_cp_layout(row.cu_seqlens, cp)
