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

The packed row itself (:mod:`cp_varlen_attn.hf_row`, whose functions this module re-exports):
under CP every rank holds the whole row; :func:`packed_hidden_states` embeds it (vision
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

import torch.distributed as dist
from torch import nn

from cp_varlen_attn.attention import varlen_attention
from cp_varlen_attn.hf_gdn import GDN_ATTRIBUTES, packed_gated_deltanet_forward
from cp_varlen_attn.hf_row import check_mask, embed_packed_row, pack_for_model, packed_hidden_states
from cp_varlen_attn.mrope import mrope_positions

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
    check_mask(mask, whole)


def enable_packing(
    model: nn.Module, *, attention_backend: str = "auto", gdn_backend: str = "auto"
) -> list[str]:
    """Adapt a transformers Qwen3.5 / Qwen3.5-MoE model (text or VLM) in place for packed rows
    (module docstring); idempotent. Returns the adapted Gated DeltaNet module paths.

    ``attention_backend`` (``auto`` / ``torch`` / ``torch_varlen`` / ``flash``,
    :func:`varlen_attention`) and ``gdn_backend`` (``auto`` / ``torch`` / ``fla``,
    :func:`gated_delta_rule`): the kernels the adapted layers call, kept on each layer
    (``attention_backend`` / ``gdn_backend`` attributes); a named backend that cannot run raises
    when the layer runs."""
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
