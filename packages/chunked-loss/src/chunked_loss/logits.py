"""``chunked_cross_entropy``: cross-entropy of logits the caller already has, without an fp32 copy.

``F.cross_entropy`` on bf16 logits after ``.float()`` keeps an fp32 [N, V] tensor (and its
log-softmax) alive until backward. Here the forward upcasts one [chunk, V] block at a time to
get ``lse`` ([N] fp32) and the target logits; only the logits themselves (in their own dtype, the
caller's tensor, so no new memory) and ``lse`` are saved. The backward rebuilds
``softmax - onehot`` per chunk from them — exact, since ``softmax(z)_v = exp(z_v - lse)`` — and
writes it, scaled by the per-token incoming gradient, into the [N, V] gradient in the logits'
dtype (that gradient is the function's output and cannot be avoided).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from chunked_loss._checks import (
    check_label_range,
    check_options,
    check_shapes,
    default_chunk_size,
    forbid_double_backward,
)
from chunked_loss._reduce import reduce_loss

__all__ = ["chunked_cross_entropy"]


class _LogitsCrossEntropy(torch.autograd.Function):
    """``(logits [N, V], labels [N], ignore_index, chunk_size) -> loss [N]`` fp32."""

    @staticmethod
    def forward(ctx, logits_NV, labels_N, ignore_index: int, chunk_size: int):
        n_tokens = logits_NV.shape[0]
        valid_N = labels_N != ignore_index
        col_N = torch.where(valid_N, labels_N.long(), 0)
        lse_N = torch.zeros(n_tokens, dtype=torch.float32, device=logits_NV.device)
        target_N = torch.zeros_like(lse_N)
        for s in range(0, n_tokens, chunk_size):
            e = min(s + chunk_size, n_tokens)
            z_CV = logits_NV[s:e].float()
            lse_N[s:e] = torch.logsumexp(z_CV, dim=-1)
            target_N[s:e] = z_CV.gather(1, col_N[s:e, None]).squeeze(1)
            del z_CV
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(logits_NV, valid_N, col_N, lse_N)
        return torch.where(valid_N, lse_N - target_N, 0.0)

    @staticmethod
    def backward(ctx, grad_N):
        forbid_double_backward("chunked_cross_entropy")
        logits_NV, valid_N, col_N, lse_N = ctx.saved_tensors
        scale_N = torch.where(valid_N, grad_N.float(), 0.0)
        grad_NV = torch.empty_like(logits_NV)
        n_tokens = logits_NV.shape[0]
        for s in range(0, n_tokens, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n_tokens)
            dz_CV = logits_NV[s:e].to(torch.float32, copy=True)  # never overwrite the logits
            dz_CV.sub_(lse_N[s:e, None]).exp_()
            dz_CV.scatter_add_(1, col_N[s:e, None], -valid_N[s:e, None].to(dz_CV.dtype))
            dz_CV.mul_(scale_N[s:e, None])
            grad_NV[s:e] = dz_CV
            del dz_CV
        return grad_NV, None, None, None


def chunked_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    num_valid_tokens: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), labels)`` without keeping an fp32 copy of ``logits``.

    Args:
        logits: [N, V] or [B, S, V] in any float dtype; saved for backward as they are.
        labels: [N] or [B, S] integer targets in ``[0, V)`` or equal to ``ignore_index``.
        reduction: ``"mean"`` over valid tokens (or ``num_valid_tokens``), ``"sum"``, ``"none"``.
        chunk_size: tokens per chunk; default keeps one fp32 [chunk, V] block near 256 MiB.
        num_valid_tokens: global count of non-ignored labels that ``"mean"`` divides by.

    Returns:
        fp32 loss (scalar, or shaped like ``labels`` for ``"none"``); 0 with zero gradient when
        every label is ignored. The gradient has the logits' dtype. Double backward raises.
    """
    check_options(reduction, chunk_size, 0.0, num_valid_tokens)
    for name, t in (("logits", logits), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if isinstance(t, DTensor):
            raise TypeError(
                f"{name} must be a plain tensor; for vocab-parallel logits use "
                "linear_cross_entropy with a DTensor weight"
            )
    error = check_shapes(logits, labels, "V")
    if error is None and not logits.is_floating_point():
        error = f"logits must be a floating-point tensor, got {logits.dtype}"
    error = error or check_label_range(labels, logits.shape[-1], ignore_index)
    if error is not None:
        raise ValueError(error)
    vocab = logits.shape[-1]
    loss_N = _LogitsCrossEntropy.apply(
        logits.reshape(-1, vocab),
        labels.reshape(-1),
        ignore_index,
        chunk_size or default_chunk_size(vocab),
    )
    return reduce_loss(loss_N, labels, reduction, ignore_index, num_valid_tokens)
