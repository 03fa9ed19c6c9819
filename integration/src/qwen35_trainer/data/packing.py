"""Packed training: a rank's documents as ONE sequence, kept apart in every layer, optionally
split over context-parallel (CP) ranks.

The model adaptation, the packer and the packed forward are cp-varlen-attn's drop-in for
transformers (:mod:`cp_varlen_attn.transformers`): attention layers run block-diagonal varlen
attention (no [S, S] mask), every Gated DeltaNet layer restarts its state and convolution at each
document, and positions are each document's own multimodal RoPE positions (computed from the
config alone, :func:`cp_varlen_attn.mrope_positions`, or already by the data-loader workers), so
a packed row trains exactly like its documents run separately. This module adds what is the
trainer's: its :class:`~qwen35_trainer.data.Sample` s through :func:`cp_varlen_attn.
pack_for_model` into a :class:`~qwen35_trainer.data.Batch` and the row's
:class:`PackedInputs` (:func:`pack`), and under CP the vision tower's frames — images' and
videos' together — split over the CP ranks with cp-vision (:func:`image_features`) instead of
every rank encoding every frame.

Padding at the end of a packed row is its own "document" (it attends only to itself); its labels
and its router statistics are excluded like any padding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from cp_varlen_attn.transformers import enable_packing, pack_for_model
from cp_varlen_attn.transformers import packed_hidden_states as cp_packed_hidden_states
from cp_vision import run_vision_sharded
from qwen35_trainer.data.batch import MEDIA_FIELDS, Batch, Sample

__all__ = [
    "PackedInputs",
    "enable_packing",
    "pack",
    "packed_hidden_states",
]


@dataclasses.dataclass
class PackedInputs:
    """What the packed forward needs besides the batch: per-document M-RoPE ``position_ids``
    [3, 1, S] of the whole row, its ``layout`` over the CP ranks (one rank: ``cp_size`` 1) and
    the CP ``group`` (``None`` without CP)."""

    position_ids: torch.Tensor
    layout: Any
    group: Any = None

    def to(self, device: torch.device | str) -> PackedInputs:
        return PackedInputs(self.position_ids.to(device), self.layout, self.group)


def _document(sample: Sample) -> dict:
    doc = {"input_ids": sample.input_ids, "labels": sample.labels,
           "mm_token_type_ids": sample.mm_token_type_ids}  # fmt: skip
    for key in MEDIA_FIELDS:
        if getattr(sample, key).numel():
            doc[key] = getattr(sample, key)
    if sample.position_ids is not None:
        doc["position_ids"] = sample.position_ids
    return doc


def pack(samples: list[Sample], config: Any, pad_token_id: int, *, cp: int = 1, group: Any = None,
         multiple: int = 8, capacity: int | None = None) -> tuple[Batch, PackedInputs]:  # fmt: skip
    """``samples`` as one row (B = 1) padded to a multiple of ``multiple``, laid out over ``cp``
    ranks (``group``: the CP group). ``config``: the model's config; ``capacity``: the most
    tokens the row may hold (``data.pack_length``); a longer row is refused."""
    total = sum(len(s) for s in samples)
    if capacity is not None and total + (-total % multiple) > capacity:
        raise ValueError(
            f"a packed row of {len(samples)} documents holds {total} tokens (padded to a "
            f"multiple of {multiple}), more than data.pack_length={capacity}"
        )
    row = pack_for_model(config, [_document(s) for s in samples], cp_size=cp,
                         pad_to_multiple_of=multiple, pad_token_id=pad_token_id)  # fmt: skip
    media = {key: row[key] if key in row else getattr(samples[0], key)[:0] for key in MEDIA_FIELDS}
    batch = Batch(input_ids=row["input_ids"], attention_mask=row["attention_mask"],
                  mm_token_type_ids=row["mm_token_type_ids"], labels=row["labels"], **media)  # fmt: skip
    return batch, PackedInputs(row["position_ids"], row["cp_layout"], group)


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
        "cp_layout": packed.layout,
    }
    for key in MEDIA_FIELDS:
        if getattr(batch, key).numel():
            row[key] = getattr(batch, key)
    vision = None
    if packed.group is not None:
        vision = functools.partial(image_features, vlm, group=packed.group)
    return cp_packed_hidden_states(vlm, row, packed.group, vision=vision)


def image_features(vlm: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor, *,
                   group: Any) -> torch.Tensor:  # fmt: skip
    """[media tokens, D]: the vision tower's merged features of the row's images and videos (one
    call, images first), in order, with
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
