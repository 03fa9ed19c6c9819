"""What the data stage hands the model: one document (:class:`Sample`) and right-padded rows of
documents (:class:`Batch`); and the error a bad row raises (:class:`DataError`).

Legend: ``S`` tokens of a document or row, ``B`` rows, ``P`` patch rows of the media (one per
``[t, h, w]`` grid cell, ``C*T*P*P`` pixel values each, as the Qwen3.5 processor emits them),
``I`` / ``V`` images / videos. ``mm_token_type_ids`` is 0 for text, 1 for an image placeholder,
2 for a video placeholder. ``labels`` are unshifted (transformers' convention: the loss shifts
them by one) with :data:`IGNORE_INDEX` wherever no loss is taken (prompts, media, padding).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "IGNORE_INDEX",
    "MEDIA_FIELDS",
    "Batch",
    "DataError",
    "Sample",
    "collate",
    "present_media",
]

IGNORE_INDEX = -100

# The media tensors of a Sample / Batch: concatenated over documents in order.
MEDIA_FIELDS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


class DataError(ValueError):
    """A bad row or data file: the message names the file and row."""


def _no_rows(row: int = 0) -> torch.Tensor:
    return torch.zeros(0, row)


def _no_grids() -> torch.Tensor:
    return torch.zeros(0, 3, dtype=torch.long)


@dataclasses.dataclass
class Sample:
    """One document. ``position_ids`` [3, S]: its own M-RoPE positions, when already computed
    (data-loader workers compute them from the config, :func:`cp_varlen_attn.mrope_positions`);
    ``source``: where it came from (``file:row``), for error messages."""

    input_ids: torch.Tensor  # [S] int64
    labels: torch.Tensor  # [S] int64
    mm_token_type_ids: torch.Tensor  # [S] int64
    pixel_values: torch.Tensor = dataclasses.field(default_factory=_no_rows)  # [P_I, C*T*P*P]
    image_grid_thw: torch.Tensor = dataclasses.field(default_factory=_no_grids)  # [I, 3]
    pixel_values_videos: torch.Tensor = dataclasses.field(default_factory=_no_rows)  # [P_V, ...]
    video_grid_thw: torch.Tensor = dataclasses.field(default_factory=_no_grids)  # [V, 3]
    position_ids: torch.Tensor | None = None  # [3, S]
    source: str = ""

    def __len__(self) -> int:
        return self.input_ids.numel()


@dataclasses.dataclass
class Batch:
    """Right-padded rows, or one packed row (B = 1)."""

    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S] 1 = token, 0 = padding
    mm_token_type_ids: torch.Tensor  # [B, S]
    labels: torch.Tensor  # [B, S]
    pixel_values: torch.Tensor  # [P_I, C*T*P*P]
    image_grid_thw: torch.Tensor  # [I, 3]
    pixel_values_videos: torch.Tensor = dataclasses.field(default_factory=_no_rows)
    video_grid_thw: torch.Tensor = dataclasses.field(default_factory=_no_grids)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    @property
    def has_media(self) -> bool:
        return bool(self.pixel_values.numel() or self.pixel_values_videos.numel())


def present_media(item: Sample | Batch) -> dict[str, torch.Tensor]:
    """The media tensors ``item`` holds (:data:`MEDIA_FIELDS`), the empty ones left out: the
    media keys of a transformers model call or of a packer document."""
    return {key: getattr(item, key) for key in MEDIA_FIELDS if getattr(item, key).numel()}


def media(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """The samples' media tensors concatenated in order (empty tensors where there are none)."""
    out = {}
    for key in MEDIA_FIELDS:
        parts = [getattr(s, key) for s in samples if getattr(s, key).numel()]
        out[key] = torch.cat(parts) if parts else getattr(samples[0], key)
    return out


def collate(samples: list[Sample], pad_token_id: int) -> Batch:
    """Right-pad ``samples`` to the longest one (labels and media types 0 / ignored there)."""
    width = max(len(s) for s in samples)
    ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    mm = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s)
        ids[b, :n], labels[b, :n], mm[b, :n], mask[b, :n] = (
            s.input_ids,
            s.labels,
            s.mm_token_type_ids,
            1,
        )
    return Batch(
        input_ids=ids, attention_mask=mask, mm_token_type_ids=mm, labels=labels, **media(samples)
    )
