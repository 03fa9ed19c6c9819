"""The packed row for transformers' Qwen3.5 / Qwen3.5-MoE models (text or VLM): built, embedded
and run, for a model adapted by :func:`cp_varlen_attn.transformers.enable_packing` (which
re-exports these functions).

- :func:`pack_for_model`: one row of several documents, each with its own M-RoPE positions and
  its first label ignored, plus the balanced CP layout over ``cp_size`` ranks;
- :func:`embed_packed_row`: the whole row's input embeddings, the vision features scattered
  into their placeholders (one tower call for images and videos);
- :func:`packed_hidden_states`: this CP rank's tokens of the row through the text model, with
  their next-token labels — each rank's hidden states equal the one-process ones at its tokens;
- :func:`check_mask`: the only attention masks a packed row honours exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cp_varlen_attn.layout import Piece, shard_sequence
from cp_varlen_attn.mrope import mrope_positions, spatial_merge_size
from cp_varlen_attn.strategies import plan_cp_layout
from cp_varlen_attn.validation import validate_layout

__all__ = ["check_mask", "embed_packed_row", "pack_for_model", "packed_hidden_states"]

IGNORE_INDEX = -100
DOCUMENT_KEYS = ("input_ids", "labels", "attention_mask", "mm_token_type_ids", "position_ids",
                 "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")  # fmt: skip


def check_mask(mask: Any, pieces: list) -> None:
    """A mask is honoured when it is absent, a dict of ``None`` masks, or [1, T] 0/1 values that
    are constant on each piece and zero only on whole documents (``pieces``: (piece, whole))."""
    if mask is None or (isinstance(mask, dict) and all(m is None for m in mask.values())):
        return
    total = sum(len(p) for p, _ in pieces)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (1, total):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"packed rows take a [1, {total}] 0/1 attention_mask (or none), got {shape}: documents "
            "are kept apart by the packing layout, not by masks"
        )
    start = 0
    for piece, whole in pieces:
        values = mask[0, start : start + len(piece)]
        start += len(piece)
        lo, hi = int(values.min()), int(values.max())
        if hi > 1 or lo < 0 or (lo == 0 and (hi == 1 or not whole)):
            raise ValueError(
                f"attention_mask zeroes part of document {piece.doc} (tokens {piece.start}..{piece.end}"
                " of it): packed rows keep documents apart by their layout, so a mask may only zero "
                "whole padding documents"
            )


def _base(model: nn.Module) -> nn.Module:
    """The model without its head: ``Qwen3_5[Moe]Model`` (VLM) or the text model."""
    return model.model if hasattr(model, "lm_head") else model


def _document(doc: dict, i: int, image_id: int | None, video_id: int | None) -> dict:
    unknown = sorted(set(doc) - set(DOCUMENT_KEYS))
    if unknown:
        raise ValueError(
            f"documents[{i}] has unknown keys {unknown}; expected some of {list(DOCUMENT_KEYS)}"
        )
    if "input_ids" not in doc:
        raise ValueError(f"documents[{i}] has no input_ids")
    out = dict(doc)
    for key in ("input_ids", "labels", "attention_mask", "mm_token_type_ids"):
        if key in out:
            x = torch.as_tensor(out[key])
            if x.dim() == 2 and x.shape[0] == 1:
                x = x[0]
            if x.dim() != 1:
                raise ValueError(
                    f"documents[{i}].{key} must be [L] or [1, L], got {tuple(x.shape)}"
                )
            out[key] = x.long()
    ids = out["input_ids"]
    if ids.numel() == 0:
        raise ValueError(f"documents[{i}] is empty")
    for key in ("labels", "attention_mask", "mm_token_type_ids"):
        if key in out and out[key].shape != ids.shape:
            raise ValueError(
                f"documents[{i}].{key} has shape {tuple(out[key].shape)}, input_ids {tuple(ids.shape)}"
            )
    if "attention_mask" in out and not bool((out["attention_mask"] == 1).all()):
        raise ValueError(f"documents[{i}].attention_mask has zeros: pass documents without padding")
    if "position_ids" in out:
        pos = torch.as_tensor(out["position_ids"])
        n = ids.numel()
        integer = not (pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool)
        if tuple(pos.shape) not in ((3, n), (3, 1, n)) or not integer:
            raise ValueError(
                f"documents[{i}].position_ids must be integer [3, {n}] or [3, 1, {n}] (input_ids has "
                f"{n} tokens), got {tuple(pos.shape)} {pos.dtype}"
            )
        out["position_ids"] = pos.reshape(3, 1, n).long()
    if "mm_token_type_ids" not in out:
        mm = torch.zeros_like(ids)
        if image_id is not None:
            mm[ids == image_id] = 1
        if video_id is not None:
            mm[ids == video_id] = 2
        out["mm_token_type_ids"] = mm
    return out


def pack_for_model(
    model: nn.Module | Any,
    documents: Sequence[dict],
    *,
    cp_size: int = 1,
    pad_to_multiple_of: int = 1,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """One packed row of ``documents`` as keyword arguments for ``model(**row)``.

    ``model``: the model or its config (only the config is read, so data-loader workers can pack
    without a model). Each document is one sample's processor output: ``input_ids`` [L] or
    [1, L] and optionally ``labels`` (transformers' convention, NOT shifted; default: the ids),
    ``attention_mask`` (all ones), ``mm_token_type_ids`` (default: derived from the image / video
    token ids), ``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` +
    ``video_grid_thw``, and ``position_ids`` [3, L] or [3, 1, L] (precomputed M-RoPE positions,
    used as they are; default: :func:`mrope_positions` of the document — for a config without a
    vision config, a text model's, ``0 … L-1``).
    Returns ``input_ids``, ``labels`` (``-100`` at each document's first token — it is never
    predicted from the previous document — and on padding), ``attention_mask`` (0 on padding),
    ``position_ids`` [3, 1, S] (per-document M-RoPE), ``mm_token_type_ids``, the concatenated
    media, ``cp_layout`` (the balanced layout over ``cp_size`` ranks) and ``use_cache=False``.
    Padding to a multiple
    of ``pad_to_multiple_of`` is its own document.
    """
    if not documents:
        raise ValueError("pack_for_model needs at least one document")
    config = model.config if isinstance(model, nn.Module) else model
    text_config = getattr(config, "text_config", config)
    image_id, video_id = (
        getattr(config, "image_token_id", None),
        getattr(config, "video_token_id", None),
    )
    multimodal = getattr(config, "vision_config", None) is not None
    docs = [_document(d, i, image_id, video_id) for i, d in enumerate(documents)]
    ids, labels, masks, mm, positions = [], [], [], [], []
    for i, doc in enumerate(docs):
        n = doc["input_ids"].numel()
        label = doc.get("labels", doc["input_ids"]).clone()
        label[0] = IGNORE_INDEX
        if "position_ids" in doc:
            pos = doc["position_ids"]
        elif multimodal:
            try:
                pos = mrope_positions(config, doc["input_ids"], doc["mm_token_type_ids"],
                                      doc.get("image_grid_thw"), doc.get("video_grid_thw"))  # fmt: skip
            except ValueError as err:
                raise ValueError(f"documents[{i}]: {err}") from err
            pos = pos[:, None]
        else:
            pos = torch.arange(n).view(1, 1, -1).expand(3, 1, -1)
        ids.append(doc["input_ids"])
        labels.append(label)
        masks.append(torch.ones(n, dtype=torch.long))
        mm.append(doc["mm_token_type_ids"])
        positions.append(pos.to(torch.long))
    total = sum(x.numel() for x in ids)
    pad = -total % pad_to_multiple_of
    if pad:
        pad_id = (
            pad_token_id if pad_token_id is not None else getattr(text_config, "pad_token_id", None)
        )
        if pad_id is None:
            raise ValueError("padding needs pad_token_id (the config has none)")
        ids.append(torch.full((pad,), pad_id))
        labels.append(torch.full((pad,), IGNORE_INDEX))
        masks.append(torch.zeros(pad, dtype=torch.long))
        mm.append(torch.zeros(pad, dtype=torch.long))
        positions.append(torch.arange(pad).view(1, 1, -1).expand(3, 1, -1))
    lengths = [x.numel() for x in ids]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    row: dict[str, Any] = {
        "input_ids": torch.cat(ids)[None],
        "labels": torch.cat(labels)[None],
        "attention_mask": torch.cat(masks)[None],
        "position_ids": torch.cat(positions, dim=-1),
        "mm_token_type_ids": torch.cat(mm)[None],
    }
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [torch.as_tensor(d[key]) for d in docs if d.get(key) is not None]
        if parts:
            row[key] = torch.cat(parts)
    row["cp_layout"] = plan_cp_layout(cu, cp_size)
    row["use_cache"] = False  # training / prefill of whole documents: no decoding cache
    return row


def embed_packed_row(
    model: nn.Module,
    row: dict[str, Any],
    *,
    vision: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """[1, S, H]: the input embeddings of a whole row of :func:`pack_for_model` — the token
    embeddings with the image and video features scattered into their placeholders — as the
    model's first layer reads them. :func:`packed_hidden_states` runs the text model on them;
    a caller that needs them too (e.g. a multi-token-prediction head, which reads the embedding
    of each position's NEXT token) computes them once here and passes them in.

    ``vision(pixel_values, grid_thw) -> features`` (e.g. frames sharded over the CP ranks)
    replaces the model's own image / video encoder if given.

    Images and videos go through the vision tower in ONE call: the row's image pixels then its
    video pixels (concatenated along dim 0), with their grids concatenated likewise (the model's
    ``get_image_features`` — Qwen3.5's ``get_video_features`` is the same function — or
    ``vision``); the features are split back into the image part (``Σ prod(grid) / m²`` over the
    image grids, ``m`` the spatial merge size) and the video part, each scattered into its
    placeholders. One call, not one per kind, because under FSDP every rank must run the tower's
    modules the same number of times per forward: each run all-gathers the tower's parameters,
    and a rank with images and videos calling it twice while a rank with only images calls it
    once puts the ranks' all-gathers out of order — they hang. The features equal two separate
    calls': the tower attends within each frame and its position embeddings are per grid. A row
    with no images or videos runs no tower at all; under FSDP the caller keeps such a rank in step
    (qwen35-trainer runs the tower on a dummy frame there).
    """
    base = _base(model)
    text = getattr(base, "language_model", base)
    input_ids = row["input_ids"]
    embeds = text.get_input_embeddings()(input_ids)
    media = [(kind, row[pixels], torch.as_tensor(row[grid]))
             for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"),
                                        ("video", "pixel_values_videos", "video_grid_thw"))
             if row.get(pixels) is not None and row[pixels].numel()]  # fmt: skip
    if not media:
        return embeds
    pixels = torch.cat([px for _, px, _ in media])
    grid = torch.cat([g for _, _, g in media])
    if vision is not None:
        feats = vision(pixels, grid)
    else:  # one tower call for both kinds (get_video_features is get_image_features)
        feats = torch.cat(base.get_image_features(pixels, grid, return_dict=True).pooler_output)
    feats = feats.to(embeds.dtype)
    merge = spatial_merge_size(model.config)
    sizes = [int((g.prod(-1) // merge**2).sum()) for _, _, g in media]
    if feats.shape[0] != sum(sizes):
        raise ValueError(
            f"the vision tower gave {feats.shape[0]} features for grids of "
            f"{' + '.join(map(str, sizes))} merged tokens ({', '.join(k for k, _, _ in media)})"
        )
    for (kind, _, _), part in zip(media, feats.split(sizes), strict=True):
        key = "image_features" if kind == "image" else "video_features"
        image_mask, video_mask = base.get_placeholder_mask(
            input_ids, inputs_embeds=embeds, **{key: part}
        )
        embeds = embeds.masked_scatter(image_mask if kind == "image" else video_mask, part)
    return embeds


def packed_hidden_states(
    model: nn.Module,
    row: dict[str, Any],
    group: dist.ProcessGroup | None = None,
    *,
    vision: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    inputs_embeds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This CP rank's final hidden states [1, T, H], next-token labels [1, T] (position ``s``
    predicts token ``s + 1`` of the whole row, so a target is right whichever rank holds it)
    and token mask [1, T], for a row of :func:`pack_for_model` (``cp_size`` = the group's size).

    The row is embedded whole on every rank (:func:`embed_packed_row`, with ``vision``), unless
    the caller passes those embeddings as ``inputs_embeds`` [1, S, H]; this rank's tokens of
    them, in layout order, go through the text model.
    """
    layout = row["cp_layout"]
    validate_layout(layout, group)
    rank = dist.get_rank(group) if group is not None else 0
    cu = layout.cu_seqlens
    check_mask(
        row["attention_mask"], [(Piece(d, 0, cu[d + 1] - cu[d]), True) for d in range(len(cu) - 1)]
    )
    base = _base(model)
    text = getattr(base, "language_model", base)
    if inputs_embeds is None:
        inputs_embeds = embed_packed_row(model, row, vision=vision)
    elif tuple(inputs_embeds.shape[:2]) != tuple(row["input_ids"].shape):
        raise ValueError(
            f"inputs_embeds has shape {tuple(inputs_embeds.shape)}; the row's input_ids "
            f"{tuple(row['input_ids'].shape)} (the whole row's embeddings, embed_packed_row)"
        )
    out = text(
        inputs_embeds=shard_sequence(inputs_embeds, layout, rank, dim=1),
        position_ids=shard_sequence(row["position_ids"], layout, rank, dim=2),
        # documents are kept apart by the layout, not by masks: no [S, S] mask is built
        attention_mask={"full_attention": None, "linear_attention": None},
        use_cache=False,
        cp_layout=layout,
        cp_group=group,
    )
    next_labels = F.pad(row["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    return (
        out.last_hidden_state,
        shard_sequence(next_labels, layout, rank, dim=1),
        shard_sequence(row["attention_mask"], layout, rank, dim=1),
    )
