"""Drop-in packing and CP for transformers' Qwen3.5 / Qwen3.5-MoE models (text or VLM).

``enable_packing(model)`` adapts the model in place, parameters and state dict untouched, so that
one packed row of several documents trains exactly as the documents would separately:

- full-attention layers: their attention implementation becomes :func:`varlen_attention`
  (registered with transformers' ``AttentionInterface`` and set on the TEXT config only, so the
  vision tower keeps its own attention): causal within each document, never an [S, S] mask —
  transformers builds no mask for an implementation outside its mask registry;
- every Gated DeltaNet layer runs :func:`packed_gated_deltanet_forward`: state and conv
  history restart at every document;
- positions: :func:`pack_for_model` computes each document's multimodal RoPE positions alone
  (:func:`~cp_varlen_attn.mrope.mrope_positions` from the config — equal to the model's
  ``get_rope_index``: text, images and videos) and concatenates them.

The document layout reaches every layer as the forward kwargs ``cp_layout`` / ``cp_group``
(transformers hands unknown kwargs down to the layers; activation checkpointing replays them).
A pre-hook on the text model checks each call: ``cp_layout`` present and the attention mask
honoured exactly or refused — a 2-D mask may only zero whole documents (padding), which are
their own documents anyway, so nothing leaks; the Gated DeltaNet layers zero those tokens as
transformers does. Any other mask raises.

Under CP every rank holds the whole packed row; :func:`packed_hidden_states` embeds it (vision
features scattered into their placeholders), takes this rank's tokens in layout order and runs
the text model on them, so each rank's hidden states equal the one-process ones at its tokens;
summing gradients over the CP group gives the one-process gradients (each token, and so each
vision feature, contributes on exactly one rank).

The transformers internals relied on are checked first (:func:`check_transformers`); a missing
one raises naming the installed version and the piece.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cp_varlen_attn.attention import varlen_attention
from cp_varlen_attn.hf_gdn import GDN_ATTRIBUTES, packed_gated_deltanet_forward
from cp_varlen_attn.layout import Piece, shard_sequence
from cp_varlen_attn.mrope import mrope_positions, spatial_merge_size
from cp_varlen_attn.strategies import plan_cp_layout
from cp_varlen_attn.validation import validate_layout

__all__ = [
    "ATTENTION",
    "TESTED_TRANSFORMERS",
    "check_transformers",
    "embed_packed_row",
    "enable_packing",
    "mrope_positions",
    "pack_for_model",
    "packed_hidden_states",
]

ATTENTION = "cp_varlen_attn"
TESTED_TRANSFORMERS = (">=5.2", "<5.25")
IGNORE_INDEX = -100
DOCUMENT_KEYS = ("input_ids", "labels", "attention_mask", "mm_token_type_ids", "position_ids",
                 "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")  # fmt: skip
_MODELING = (
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5Moe"),
)
_MARK = "_cp_varlen_attn_packing"
_log = logging.getLogger(__name__)
_warned: set[str] = set()


def check_transformers() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(Gated DeltaNet layer classes, text model classes) of Qwen3.5 and Qwen3.5-MoE, after
    checking the internals this module relies on; ``ImportError`` naming the transformers
    version and the missing pieces otherwise."""
    import importlib

    import transformers

    version = transformers.__version__
    missing, gdn, text = [], [], []
    for path, prefix in _MODELING:
        try:
            module = importlib.import_module(path)
        except ImportError:
            missing.append(path)
            continue
        for name, found in ((f"{prefix}GatedDeltaNet", gdn), (f"{prefix}TextModel", text)):
            cls = getattr(module, name, None)
            if cls is None:
                missing.append(f"{path}.{name}")
            else:
                found.append(cls)
    if not hasattr(transformers, "AttentionInterface"):
        missing.append("transformers.AttentionInterface")
    try:
        from transformers import masking_utils

        registry = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        if ATTENTION in registry:  # then transformers would build [S, S] masks for it
            missing.append(f"an attention implementation {ATTENTION!r} without a mask function")
    except (ImportError, AttributeError):
        missing.append("transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping")
    if missing:
        raise ImportError(
            f"transformers {version} changed what cp_varlen_attn.transformers relies on "
            f"(tested: transformers{','.join(TESTED_TRANSFORMERS)}): missing {missing}"
        )
    _warn_untested(version)
    return tuple(gdn), tuple(text)


def _warn_untested(version: str) -> None:
    from packaging.specifiers import SpecifierSet

    if version not in SpecifierSet(",".join(TESTED_TRANSFORMERS)) and version not in _warned:
        _warned.add(version)
        _log.warning("transformers %s is outside the tested range %s; its internals checked out",
                     version, ",".join(TESTED_TRANSFORMERS))  # fmt: skip


def _packed_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                      cp_layout=None, cp_group=None, **kwargs):  # fmt: skip
    """transformers attention interface: q [1, H, T, D], k/v [1, H_kv, T, D] → ([1, T, H, D], None)."""
    if cp_layout is None:
        raise ValueError(
            f"attention {ATTENTION!r} needs cp_layout= in the model call (pack_for_model)"
        )
    if dropout:
        raise ValueError("packed attention does not implement attention dropout")
    out = varlen_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        cp_layout,
        cp_group,
        causal=True,
        softmax_scale=scaling,
        backend=getattr(module, "attention_backend", "auto"),
    )
    return out, None


def _packed_gdn(layer, hidden_states, cache=None, attention_mask=None, *, cp_layout=None,
                cp_group=None, **kwargs):  # fmt: skip
    if cp_layout is None:
        raise ValueError("a packed Gated DeltaNet layer needs cp_layout= in the model call")
    if cache is not None:
        raise ValueError("packed documents run without a cache (use_cache=False)")
    if attention_mask is not None:  # whole padding documents only (checked by the text model hook)
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    return packed_gated_deltanet_forward(
        layer,
        hidden_states,
        layout=cp_layout,
        group=cp_group,
        backend=getattr(layer, "gdn_backend", "auto"),
    )


def _check_text_call(module, args, kwargs):
    """Forward pre-hook of the text model: the layout is there, the mask is honourable."""
    layout = kwargs.get("cp_layout")
    if layout is None:
        raise ValueError(
            f"{type(module).__name__} is adapted for packed rows (cp_varlen_attn.enable_packing): "
            "call it with the inputs of pack_for_model, which carry cp_layout"
        )
    mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
    group = kwargs.get("cp_group")
    rank = dist.get_rank(group) if group is not None else 0
    cu = layout.cu_seqlens
    whole = [(p, p.start == 0 and p.end == cu[p.doc + 1] - cu[p.doc]) for p in layout.pieces[rank]]
    _check_mask(mask, whole)


def _check_mask(mask: Any, pieces: list) -> None:
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


def enable_packing(
    model: nn.Module, *, attention_backend: str = "auto", gdn_backend: str = "auto"
) -> list[str]:
    """Adapt a transformers Qwen3.5 / Qwen3.5-MoE model (text or VLM) in place for packed rows
    (module docstring); idempotent. Returns the adapted Gated DeltaNet module paths.

    ``attention_backend`` (``auto`` / ``torch`` / ``flash``, :func:`varlen_attention`) and
    ``gdn_backend`` (``auto`` / ``torch`` / ``fla``, :func:`gated_delta_rule`): the kernels the
    adapted layers call, kept on each layer (``attention_backend`` / ``gdn_backend``
    attributes); a named backend that cannot run raises when the layer runs."""
    from transformers import AttentionInterface

    gdn_classes, text_classes = check_transformers()
    if getattr(model, _MARK, None) is not None:
        return getattr(model, _MARK)
    texts = [m for m in model.modules() if isinstance(m, text_classes)]
    if not texts:
        raise ValueError(f"{type(model).__name__} has no Qwen3.5 text model to adapt")
    AttentionInterface.register(ATTENTION, _packed_attention)
    for module in model.modules():  # the text model's attention layers and any beside it
        if hasattr(module, "q_proj") and hasattr(module, "o_proj"):
            module.attention_backend = attention_backend
    for text in texts:
        text.config._attn_implementation = ATTENTION
        text.register_forward_pre_hook(_check_text_call, with_kwargs=True)
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", config)
    if text_config is not None:
        text_config._attn_implementation = ATTENTION
    patched = []
    for path, module in model.named_modules():
        if isinstance(module, gdn_classes):
            absent = [a for a in GDN_ATTRIBUTES if not hasattr(module, a)]
            if absent:
                raise ImportError(
                    f"{type(module).__name__} at {path!r} lacks {absent}: transformers changed it"
                )
            module.forward = functools.partial(_packed_gdn, module)
            module.gdn_backend = gdn_backend
            patched.append(path)
    setattr(model, _MARK, patched)
    return patched


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
    _check_mask(
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
