"""Argument checks shared by every entry point.

Each check returns an error message (or ``None``) instead of raising, so that the vocab-parallel
path can agree on the outcome with its TP peers (one tiny all-reduce of a flag) before any rank
raises; the single-process paths simply raise the message.
"""

from __future__ import annotations

import torch

REDUCTIONS = ("mean", "sum", "none")

# Bytes the per-chunk working set may take when the caller does not pick a chunk size.
CHUNK_BUDGET_BYTES = 256 << 20


def default_chunk_size(vocab: int) -> int:
    """Rows per chunk of ``chunked_cross_entropy``: its working set is one fp32 [chunk, V]
    block, ``4·V`` bytes a row, so ``floor(budget / (4·V))`` rows fit ``CHUNK_BUDGET_BYTES``."""
    return max(1, CHUNK_BUDGET_BYTES // (4 * max(vocab, 1)))


def _linear_row_bytes(vocab: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes one row of a ``linear_cross_entropy`` chunk holds (:func:`linear_chunk_size`)."""
    size = torch.empty((), dtype=dtype).element_size()
    per_row = 4 * vocab + size * hidden
    if dtype != torch.float32:
        per_row += size * vocab + 4 * hidden
    return per_row


def linear_chunk_size(vocab: int, hidden: int, dtype: torch.dtype) -> int:
    """The largest chunk of ``linear_cross_entropy`` whose working set fits the budget.

    Per row of a chunk (V = this process's vocabulary slice, H = hidden size, s = the inputs'
    bytes per element): the fp32 logits/gradient row ``4·V``, the gathered hidden row ``s·H``
    and, for inputs that are not fp32, the row of logits or gradient in their dtype around the
    matmuls ``s·V`` plus the fp32 copy of the hidden row ``4·H``:
    ``rows = max(1, floor(budget / (4·V + s·H + [s ≠ 4]·(s·V + 4·H))))`` — e.g. 269 rows for
    fp32 and 179 for bf16 at V = 248,320, H = 1024 with the 256 MiB budget.
    """
    return max(1, CHUNK_BUDGET_BYTES // max(_linear_row_bytes(vocab, hidden, dtype), 1))


def linear_chunk_bytes(rows: int, vocab: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of the working set ``linear_cross_entropy`` holds at once with its default chunk
    size, for ``rows`` valid rows: one chunk of at most :func:`linear_chunk_size` of them, each
    row's bytes as stated there (at most ``CHUNK_BUDGET_BYTES``; fewer where the rows or the
    vocabulary are small)."""
    chunk = min(max(rows, 0), linear_chunk_size(vocab, hidden, dtype))
    return chunk * _linear_row_bytes(vocab, hidden, dtype)


def check_options(
    reduction: object, chunk_size: object, label_smoothing: object, num_valid_tokens: object
) -> None:
    """Options that are the same on every rank: raise at once."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, int | float):
        raise TypeError(f"label_smoothing must be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if num_valid_tokens is None:
        return
    if isinstance(num_valid_tokens, torch.Tensor):
        if num_valid_tokens.numel() != 1 or num_valid_tokens.is_floating_point():
            raise TypeError(
                "num_valid_tokens must be an int or a one-element integer tensor, got a "
                f"{num_valid_tokens.dtype} tensor of shape {tuple(num_valid_tokens.shape)}"
            )
        return
    if isinstance(num_valid_tokens, bool) or not isinstance(num_valid_tokens, int):
        raise TypeError(
            f"num_valid_tokens must be an int or a one-element integer tensor, got {type(num_valid_tokens).__name__}"
        )
    if num_valid_tokens < 0:
        raise ValueError(f"num_valid_tokens must be >= 0, got {num_valid_tokens}")


def check_shapes(
    hidden: torch.Tensor, labels: torch.Tensor, last_dim_name: str = "H"
) -> str | None:
    """``hidden`` is [N, X] or [B, S, X] and ``labels`` the matching [N] or [B, S]."""
    if hidden.dim() not in (2, 3):
        return f"expected a [N, {last_dim_name}] or [B, S, {last_dim_name}] tensor, got shape {tuple(hidden.shape)}"
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        return f"labels must be an integer tensor, got dtype {labels.dtype}"
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        return (
            f"labels shape {tuple(labels.shape)} does not match the leading dims of the "
            f"[..., {last_dim_name}] input {tuple(hidden.shape)} (expected {tuple(hidden.shape[:-1])})"
        )
    return None


def check_weight(hidden: torch.Tensor, weight_shape: torch.Size, bias_shape: torch.Size | None):
    """``weight`` is [V, H] with H = hidden's last dim; ``bias`` is [V]."""
    if len(weight_shape) != 2:
        return f"weight must be [V, H], got shape {tuple(weight_shape)}"
    if weight_shape[1] != hidden.shape[-1]:
        return (
            f"hidden width {hidden.shape[-1]} does not match weight [V, H] = {tuple(weight_shape)} "
            f"(expected H = {weight_shape[1]})"
        )
    if bias_shape is not None and tuple(bias_shape) != (weight_shape[0],):
        return f"bias must be [V] = ({weight_shape[0]},), got shape {tuple(bias_shape)}"
    return None


def check_label_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> str | None:
    """Every label is ``ignore_index`` or in ``[0, vocab)``."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        value = int(labels[bad][0])
        count = int(bad.sum())
        return (
            f"labels must be in [0, {vocab}) or equal ignore_index={ignore_index}; "
            f"got {count} out-of-range label(s), first {value}"
        )
    return None


def forbid_double_backward(name: str) -> None:
    """Called at the top of a hand-written backward: grad mode is on there only when the caller
    asked for ``create_graph=True``, and the hand-written backward is not differentiable."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name} does not support double backward (create_graph=True): its backward is "
            "hand-written per chunk and is not itself differentiable"
        )
