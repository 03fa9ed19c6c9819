"""The FLOP model behind the ``mfu`` metric (model FLOPs utilisation, on GPU).

Model FLOPs of one training step = 3 × the forward's (the backward costs twice the forward;
activation recomputation is NOT counted, as usual for MFU). The forward of a token costs 2 FLOPs
per weight it multiplies:

- text, per token: every projection of its layer's mixer (gated attention: q+gate, k, v, o;
  Gated DeltaNet: fused qkv, z, b, a, out, and the depthwise causal conv), the router, its
  ``k`` routed experts and the shared expert with its gate, and the ``lm_head``; plus, per
  full-attention layer, scores and values over the causal context inside its document
  (``2·2·heads·head_dim`` per (query, key) pair, ``n(n+1)/2`` pairs in a document of ``n``),
  and per Gated DeltaNet layer the recurrent state's update, delta and read-out
  (``3 · 2·v_heads·k_dim·v_dim`` per token);
- the multi-token-prediction head, per depth and token: its ``fc`` (``2H·H``), one
  full-attention layer (projections, MoE, and the attention pairs within each document) and the
  ``lm_head`` again (:mod:`qwen35_trainer.model.mtp`);
- vision, per patch: every block's projections and MLP and the patch embedding; the merger per
  merged token; attention over the patches of the same frame (``2·2·hidden`` per pair).

The embedding lookup and norms are not counted. ``peak_flops`` is the accelerator's dense bf16
peak (a table of datasheet numbers, or ``QWEN35_PEAK_FLOPS``); without it there is no MFU.

:func:`forward_flops` is the same forward split by kind (:data:`KINDS`: each mixer's
projections and its attention / recurrence core, the shared expert with the router, the routed
experts, the MTP head's ``fc``, the loss's ``lm_head``, the vision tower's projections and its
per-frame attention) and restricted to a part of the model (a pipeline stage's layers, with or
without the tower, the head and the MTP head): the planner's step-time model
(:mod:`qwen35_trainer.plan.work`) prices each kind on its own. :func:`training_flops` is three
times its sum over the whole model, so the two cannot disagree.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["KINDS", "PEAK_BF16_FLOPS", "forward_flops", "peak_flops", "training_flops"]

# Dense bf16 tensor-core peaks (datasheets, SXM parts), matched against the device name.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
}

# the kinds of :func:`forward_flops`, in the order the planner reports them
KINDS = (
    "attention",  # full-attention projections: q with its gate, k, v, o
    "attention_core",  # scores and values over the causal pairs of each document
    "gdn",  # Gated DeltaNet projections (qkv, z, b, a, out) and the depthwise conv
    "gdn_core",  # the gated delta rule's state update, delta and read-out
    "shared_expert",  # the router, the shared SwiGLU expert and its gate
    "experts",  # the k routed SwiGLU experts of each token
    "mtp",  # the MTP head's fc over [embedding, hidden]
    "loss",  # the lm_head (the model's, and once more per MTP depth)
    "vision",  # the tower's patch embedding, blocks and merger
    "vision_core",  # the tower's attention within each frame
)


def peak_flops(device: torch.device) -> float | None:
    """FLOP/s one device can do (``QWEN35_PEAK_FLOPS`` overrides the table); ``None`` on CPU or
    an unknown GPU."""
    if os.environ.get("QWEN35_PEAK_FLOPS"):
        return float(os.environ["QWEN35_PEAK_FLOPS"])
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def _text_weights_per_token(text) -> dict[str, int]:
    """Weights one token multiplies in each kind of decoder layer (and the head)."""
    h, hd = text.hidden_size, text.head_dim
    q, kv = text.num_attention_heads * hd, text.num_key_value_heads * hd
    qk = text.linear_num_key_heads * text.linear_key_head_dim
    v = text.linear_num_value_heads * text.linear_value_head_dim
    conv = 2 * qk + v
    moe = (
        h * text.num_experts
        + text.num_experts_per_tok * 3 * h * text.moe_intermediate_size
        + 3 * h * text.shared_expert_intermediate_size
        + h
    )
    return {
        "attention_mixer": h * 2 * q + 2 * h * kv + q * h,
        "full_attention": h * 2 * q + 2 * h * kv + q * h + moe,
        "linear_attention": h * conv
        + h * v
        + 2 * h * text.linear_num_value_heads
        + v * h
        + conv * text.linear_conv_kernel_dim
        + moe,
        "head": text.vocab_size * h,
    }


def forward_flops(
    config: Any,
    doc_lengths: Sequence[int],
    image_grids: Sequence[Sequence[int]],
    *,
    layer_types: Sequence[str] | None = None,
    mtp: int | None = None,
    head: bool = True,
) -> dict[str, int]:
    """Forward FLOPs of each kind (:data:`KINDS`) over documents of ``doc_lengths`` tokens and
    images / videos of patch grids ``[t, h, w]`` (module docstring), through the decoder layers
    ``layer_types`` (default: all), ``mtp`` MTP depths (default: the config's) and the
    ``lm_head`` when ``head``; pass no grids for a part without the tower."""
    text, vision = config.text_config, config.vision_config
    layer_types = text.layer_types if layer_types is None else layer_types
    depth = getattr(text, "mtp_num_hidden_layers", 0) if mtp is None else mtp
    tokens, h = sum(doc_lengths), text.hidden_size
    w = _text_weights_per_token(text)
    pairs = sum(n * (n + 1) // 2 for n in doc_lengths)
    linear = sum(t == "linear_attention" for t in layer_types)
    full = len(layer_types) - linear + depth  # each MTP depth is one more full-attention layer
    moe_layers = len(layer_types) + depth
    routed = text.num_experts_per_tok * 3 * h * text.moe_intermediate_size
    moe = w["full_attention"] - w["attention_mixer"]
    state = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim
    counts = {
        "attention": 2 * tokens * w["attention_mixer"] * full,
        "attention_core": full * 4 * text.num_attention_heads * text.head_dim * pairs,
        "gdn": 2 * tokens * (w["linear_attention"] - moe) * linear,
        "gdn_core": linear * tokens * 3 * 2 * state,
        "shared_expert": 2 * tokens * (moe - routed) * moe_layers,
        "experts": 2 * tokens * routed * moe_layers,
        "mtp": 2 * tokens * 2 * h * h * depth,
        "loss": 2 * tokens * w["head"] * (int(head) + depth),
        "vision": 0,
        "vision_core": 0,
    }
    vh, merge = vision.hidden_size, vision.spatial_merge_size**2
    pixels = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    block = 4 * vh * vh + 2 * vh * vision.intermediate_size
    merger = (vh * merge) ** 2 + vh * merge * vision.out_hidden_size
    for t, hh, ww in image_grids:
        patches = t * hh * ww
        counts["vision"] += 2 * patches * (pixels * vh + vision.depth * block + merger // merge)
        counts["vision_core"] += vision.depth * t * 4 * vh * (hh * ww) ** 2
    return counts


def training_flops(
    config, doc_lengths: Sequence[int], image_grids: Sequence[Sequence[int]]
) -> float:
    """Model FLOPs of one forward + backward over documents of ``doc_lengths`` tokens and
    images / videos of patch grids ``[t, h, w]`` (module docstring): three forwards of the whole
    model (:func:`forward_flops`)."""
    return 3.0 * sum(forward_flops(config, doc_lengths, image_grids).values())


def layer_costs(config: Any, row: int | None) -> tuple[list[float], float, float]:
    """``(per decoder layer, first-stage extra, last-stage extra)`` training FLOPs of one row of
    ``row`` tokens, one document, for balancing pipeline stages: each layer's own (full
    attention and Gated DeltaNet layers differ, their MoE blocks are the same), the vision
    tower on one frame whose merged tokens fill a quarter of the row (the first stage's), and
    the head with the MTP layers (the last's)."""
    row = row or 4096  # the nominal row without data.pack_length
    text, vision = config.text_config, config.vision_config
    one = functools.partial(_flops_with, config, row)
    per_type = {kind: one(layer_types=[kind], mtp=0) - one(layer_types=[], mtp=0)
                for kind in set(text.layer_types)}  # fmt: skip
    # one frame whose merged tokens fill a quarter of the row (no text tokens: vision alone)
    side = vision.spatial_merge_size * max(1, int((row / 4) ** 0.5))
    tower = training_flops(config, [0], [[1, side, side]])
    last = one(layer_types=[], mtp=getattr(text, "mtp_num_hidden_layers", 0))
    return [per_type[kind] for kind in text.layer_types], tower, last


def _flops_with(config: Any, row: int, *, layer_types: list[str], mtp: int) -> float:
    """The FLOPs of a ``row``-token row through a copy of ``config`` with ``layer_types`` and
    an ``mtp``-layer head (the caller's config is left as it was: an export writes it)."""
    config = copy.deepcopy(config)
    config.text_config.layer_types, config.text_config.mtp_num_hidden_layers = layer_types, mtp
    return training_flops(config, [row], [])
