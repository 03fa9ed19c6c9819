"""Packed training: a rank's samples as ONE sequence, documents kept apart in every layer,
optionally split over context-parallel (CP) ranks.

The model adaptation and the packed forward are cp-varlen-attn's drop-in for transformers
(:mod:`cp_varlen_attn.transformers`): attention layers run block-diagonal varlen attention (no
[S, S] mask), every Gated DeltaNet layer restarts its state and convolution at each document,
and positions are each document's own multimodal RoPE positions, so a packed row trains exactly
like its documents run separately. This module adds what is the trainer's: packing its
:class:`~qwen35_trainer.data.Sample` s into a row (:func:`pack`), the row's layout over the CP
ranks (:func:`row_layout`), and under CP the vision tower's frames split over the CP ranks with
cp-vision (:func:`image_features`) instead of every rank encoding every frame.

Padding at the end of a packed row is its own "document" (it attends only to itself); its labels
and its router statistics are excluded like any padding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from cp_varlen_attn import plan_cp_layout
from cp_varlen_attn.transformers import enable_packing
from cp_varlen_attn.transformers import packed_hidden_states as cp_packed_hidden_states
from cp_vision import run_vision_sharded
from qwen35_trainer.data import IGNORE_INDEX, Batch, Sample, text_vocab

__all__ = [
    "PackedBatch",
    "PackedInputs",
    "enable_packing",
    "pack",
    "packed_hidden_states",
    "row_layout",
]


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


def pack(samples: list[Sample], model_spec: Any, rope_index, pad_token_id: int,
         multiple: int = 8, capacity: int | None = None) -> PackedBatch:  # fmt: skip
    """Concatenate ``samples`` into one row padded to a multiple of ``multiple``.

    ``rope_index``: the model's ``get_rope_index`` (positions of one document). ``capacity``:
    the most tokens a row may hold (``data.pack_length``); a longer row is refused.
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
    if capacity is not None and total + (-total % multiple) > capacity:
        raise ValueError(
            f"a packed row of {len(samples)} documents holds {total} tokens (padded to a "
            f"multiple of {multiple}), more than data.pack_length={capacity}"
        )
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
    """This CP rank's final hidden states [1, T, H], next-token labels [1, T] and token mask:
    :func:`cp_varlen_attn.transformers.packed_hidden_states` of the row, with the vision frames
    sharded over the CP ranks (:func:`image_features`) under CP."""
    row = {
        "input_ids": batch.input_ids,
        "labels": batch.labels,
        "attention_mask": batch.attention_mask,
        "position_ids": packed.position_ids,
        "pixel_values": batch.pixel_values,
        "image_grid_thw": batch.image_grid_thw,
        "cp_layout": packed.layout,
    }
    vision = None
    if packed.group is not None:
        vision = functools.partial(image_features, vlm, group=packed.group)
    return cp_packed_hidden_states(vlm, row, packed.group, vision=vision)


def image_features(vlm: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor, *,
                   group: Any) -> torch.Tensor:  # fmt: skip
    """[image tokens, D]: the vision tower's merged features of the row's images, in order, with
    the frames split over the CP ranks by :func:`cp_vision.run_vision_sharded` (each rank encodes
    a cost-balanced contiguous slice; a variable-length all-gather reassembles all features on
    every rank, its backward sums every rank's gradient for a slice onto the rank that encoded
    it), so the tower's work is not replicated. The result equals the unsharded tower's because
    Qwen3.5's tower attends only within a frame and its position embeddings are spatial."""
    tower = vlm.visual
    return run_vision_sharded(
        lambda rows, grid: tower(rows, grid_thw=grid).pooler_output,
        pixel_values.type(tower.dtype),
        grid_thw,
        group,
        trainable=any(p.requires_grad for p in tower.parameters()),
    )


def row_layout(row: PackedBatch, cp: int = 1):
    """The layout of a packed row over ``cp`` ranks (balanced; one rank without CP)."""
    return plan_cp_layout(row.cu_seqlens, cp)
