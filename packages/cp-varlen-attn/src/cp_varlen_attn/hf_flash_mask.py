"""Keep packed-document boundaries of an "indexed" attention mask under transformers' FlashAttention.

transformers 5.x turns every 2-D attention mask into ``bool`` before building the attention
mask (``masking_utils._preprocess_mask_arguments``), and its FlashAttention path derives
``cu_seqlens`` from the mask's row sums (``modeling_flash_attention_utils._get_unpad_data``).
An indexed mask ``[1, 1, 2, 2, 2, 0]`` therefore becomes one 5-token sequence: documents
attend to each other, silently.

:func:`preserve_indexed_mask_for_flash_attention` patches those two functions so that, for
FlashAttention implementations only and only for integer masks holding ids above 1:

1. the mask reaches the attention layers unchanged (as a prepared mask would), and
2. the unpadding splits it into one varlen sequence per document (per run of equal non-zero
   ids in each row), so ``flash_attn_varlen_func`` sees every document boundary.

Every other mask and implementation goes to the original functions. The patch checks the
internals it relies on first and raises if they changed, rather than patching blindly.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

__all__ = ["preserve_indexed_mask_for_flash_attention", "unpad_data_from_indexed_mask"]

_MARK = "_cp_varlen_attn_indexed_mask"


def unpad_data_from_indexed_mask(mask_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(indices, cu_seqlens, max_seqlen) of an indexed mask [B, S]: one sequence per document.

    ``indices`` are the flat positions of non-padding tokens; ``cu_seqlens`` (int32) bounds each
    run of equal non-zero ids, row by row, so a document never continues into the next row.
    """
    flat = mask_BS.reshape(-1)
    indices = torch.nonzero(flat != 0).flatten()
    ids = flat[indices]
    rows = indices // mask_BS.shape[-1]
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = (ids[1:] != ids[:-1]) | (rows[1:] != rows[:-1])
    start_pos = torch.nonzero(starts).flatten()
    lengths = torch.diff(start_pos, append=torch.tensor([ids.numel()], device=ids.device))
    cu_seqlens = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    return indices, cu_seqlens, max_seqlen


def _is_indexed(mask: object) -> bool:
    return (
        isinstance(mask, torch.Tensor)
        and mask.dim() == 2
        and not mask.dtype.is_floating_point
        and mask.dtype != torch.bool
        and bool((mask > 1).any())
    )


def _uses_flash(config: object) -> bool:
    return str(getattr(config, "_attn_implementation", "") or "").startswith("flash_attention")


def preserve_indexed_mask_for_flash_attention() -> None:
    """Patch transformers (once; idempotent) so FlashAttention honours indexed masks.

    Raises ``RuntimeError`` naming the installed transformers version and the missing piece
    when the functions this relies on are not what it expects.
    """
    import transformers
    from transformers import masking_utils
    from transformers import modeling_flash_attention_utils as fa_utils

    _check_internals(transformers.__version__, masking_utils, fa_utils)
    if getattr(masking_utils._preprocess_mask_arguments, _MARK, False):
        return

    original_preprocess = masking_utils._preprocess_mask_arguments
    original_unpad = fa_utils._get_unpad_data

    @functools.wraps(original_preprocess)
    def preprocess(config, inputs_embeds, attention_mask, *args, **kwargs):
        if _uses_flash(config) and _is_indexed(attention_mask):
            # early exit: the indexed mask goes to the attention layers as it is
            return True, attention_mask.to(inputs_embeds.device), None, None, None, None, None
        return original_preprocess(config, inputs_embeds, attention_mask, *args, **kwargs)

    @functools.wraps(original_unpad)
    def unpad(attention_mask):
        if _is_indexed(attention_mask):
            return unpad_data_from_indexed_mask(attention_mask)
        return original_unpad(attention_mask)

    setattr(preprocess, _MARK, True)
    setattr(unpad, _MARK, True)
    masking_utils._preprocess_mask_arguments = preprocess
    fa_utils._get_unpad_data = unpad


def _check_internals(version: str, masking_utils: object, fa_utils: object) -> None:
    problems = []
    preprocess = getattr(masking_utils, "_preprocess_mask_arguments", None)
    if preprocess is None:
        problems.append("masking_utils._preprocess_mask_arguments is gone")
    else:
        params = list(inspect.signature(preprocess).parameters)[:3]
        if params != ["config", "inputs_embeds", "attention_mask"]:
            problems.append(
                f"masking_utils._preprocess_mask_arguments takes {params}, expected config, inputs_embeds, attention_mask"
            )
    create = getattr(masking_utils, "create_causal_mask", None)
    if (
        create is None
        or "_preprocess_mask_arguments" not in inspect.unwrap(create).__code__.co_names
    ):
        problems.append(
            "masking_utils.create_causal_mask no longer calls _preprocess_mask_arguments"
        )
    unpad = getattr(fa_utils, "_get_unpad_data", None)
    if unpad is None or list(inspect.signature(unpad).parameters) != ["attention_mask"]:
        problems.append(
            "modeling_flash_attention_utils._get_unpad_data(attention_mask) is gone or changed"
        )
    upad = getattr(fa_utils, "_upad_input", None)
    if upad is None or "_get_unpad_data" not in upad.__code__.co_names:
        problems.append(
            "modeling_flash_attention_utils._upad_input no longer calls _get_unpad_data"
        )
    if problems:
        raise RuntimeError(
            f"preserve_indexed_mask_for_flash_attention: transformers {version} changed the internals it patches: "
            + "; ".join(problems)
        )
