"""Every forward that packing and CP change, in one place.

The model adaptation and the packed forward are cp-varlen-attn's drop-in for transformers
(:mod:`cp_varlen_attn.transformers`): attention layers run block-diagonal varlen attention (no
[S, S] mask), every Gated DeltaNet layer restarts its state and convolution at each document,
and positions are each document's own multimodal RoPE positions, so a packed row trains exactly
like its documents run separately (:func:`enable_packing`, :func:`packed_hidden_states`). Under
CP the vision tower's frames — images' and videos' together — are split over the CP ranks with
cp-vision (:func:`image_features`) instead of every rank encoding every frame; a rank whose rows
hold no picture runs the tower on one dummy frame (:func:`dummy_vision`) so every rank runs it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from cp_varlen_attn.transformers import embed_packed_row, enable_packing
from cp_varlen_attn.transformers import packed_hidden_states as cp_packed_hidden_states
from cp_vision import run_vision_sharded
from qwen35_trainer.data.batch import Batch, present_media
from qwen35_trainer.data.packing import PackedInputs

__all__ = ["dummy_vision", "enable_packing", "image_features", "packed_hidden_states"]


def packed_hidden_states(
    vlm: nn.Module, batch: Batch, packed: PackedInputs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This CP rank's final hidden states [1, T, H], next-token labels [1, T] and token mask,
    and the WHOLE row's input embeddings [1, S, H] (the MTP head reads them,
    :mod:`qwen35_trainer.model.mtp`): :func:`cp_varlen_attn.transformers.packed_hidden_states`
    of the row, with the vision frames sharded over the CP ranks (:func:`image_features`) under
    CP."""
    row = {
        "input_ids": batch.input_ids,
        "labels": batch.labels,
        "attention_mask": batch.attention_mask,
        "position_ids": packed.position_ids,
        "cp_layout": packed.layout,
        **present_media(batch),
    }
    vision = None
    if packed.group is not None:
        vision = functools.partial(image_features, vlm, group=packed.group)
    embeds_BSH = embed_packed_row(vlm, row, vision=vision)
    hidden, labels, tokens = cp_packed_hidden_states(
        vlm, row, packed.group, inputs_embeds=embeds_BSH
    )
    return hidden, labels, tokens, embeds_BSH


def image_features(
    vlm: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor, *, group: Any
) -> torch.Tensor:
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


def dummy_vision(vlm: nn.Module) -> torch.Tensor:
    """The vision tower's merged features of one zero frame of the smallest grid (one merged
    token): run by rows without images so every rank runs the tower (see the module docstring)."""
    tower = vlm.visual
    merge = tower.spatial_merge_size
    config = tower.config
    row = config.in_channels * config.temporal_patch_size * config.patch_size**2
    device = next(tower.parameters()).device
    pixels = torch.zeros(merge * merge, row, device=device, dtype=tower.dtype)
    grid = torch.tensor([[1, merge, merge]], device=device)
    return tower(pixels, grid_thw=grid).pooler_output
