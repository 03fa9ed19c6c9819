"""Packed rows as data: a rank's documents as ONE sequence and what the packed forward needs
to keep them apart (:mod:`qwen35_trainer.model.packed` runs it).

:func:`pack` sends the trainer's :class:`~qwen35_trainer.data.Sample` s through
cp-varlen-attn's packer (:func:`cp_varlen_attn.transformers.pack_for_model`): one
:class:`~qwen35_trainer.data.Batch` row and its :class:`PackedInputs` — every document's own
multimodal RoPE positions (computed from the config alone, :func:`cp_varlen_attn.
mrope_positions`, or already by the data-loader workers) and the row's layout over the CP ranks.

Padding at the end of a packed row is its own "document" (it attends only to itself); its labels
and its router statistics are excluded like any padding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cp_varlen_attn.transformers import pack_for_model
from qwen35_trainer.data.batch import MEDIA_FIELDS, Batch, Sample, present_media

__all__ = ["PackedInputs", "pack", "pad_token_id"]


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
    doc = {
        "input_ids": sample.input_ids,
        "labels": sample.labels,
        "mm_token_type_ids": sample.mm_token_type_ids,
        **present_media(sample),
    }
    if sample.position_ids is not None:
        doc["position_ids"] = sample.position_ids
    return doc


def pack(
    samples: list[Sample],
    config: Any,
    pad_token_id: int,
    *,
    cp: int = 1,
    group: Any = None,
    multiple: int = 8,
    capacity: int | None = None,
) -> tuple[Batch, PackedInputs]:
    """``samples`` as one row (B = 1) padded to a multiple of ``multiple``, laid out over ``cp``
    ranks (``group``: the CP group). ``config``: the model's config; ``capacity``: the most
    tokens the row may hold (``data.pack_length``); a longer row is refused."""
    total = sum(len(s) for s in samples)
    if capacity is not None and total + (-total % multiple) > capacity:
        raise ValueError(
            f"a packed row of {len(samples)} documents holds {total} tokens (padded to a "
            f"multiple of {multiple}), more than data.pack_length={capacity}"
        )
    row = pack_for_model(
        config,
        [_document(s) for s in samples],
        cp_size=cp,
        pad_to_multiple_of=multiple,
        pad_token_id=pad_token_id,
    )
    media = {key: row[key] if key in row else getattr(samples[0], key)[:0] for key in MEDIA_FIELDS}
    batch = Batch(
        input_ids=row["input_ids"],
        attention_mask=row["attention_mask"],
        mm_token_type_ids=row["mm_token_type_ids"],
        labels=row["labels"],
        **media,
    )
    return batch, PackedInputs(row["position_ids"], row["cp_layout"], group)


def pad_token_id(config: Any) -> int:
    """The id a packed row's padding run and right-padded rows are filled with (never a label,
    never attended): the text config's ``pad_token_id``, else its end-of-text id (the public
    Qwen3.5 configs have no pad id), else 0. Not written into the config: transformers would make
    it the embedding's padding index, whose row then never trains."""
    text = config.text_config
    for value in (text.pad_token_id, getattr(text, "eos_token_id", None)):
        if isinstance(value, list | tuple):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0
