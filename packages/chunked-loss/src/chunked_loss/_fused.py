"""The chunked linear cross-entropy with its gradients formed during the forward (scalar losses).

For ``reduction="sum"`` (and ``"mean"``, which is that sum divided by a constant), the loss is a
scalar ``L = Σ_i loss_i``, so its gradients for any upstream scalar gradient ``g`` are
``g · ∂L/∂h``, ``g · ∂L/∂W`` and ``g · ∂L/∂b``. Everything in ``∂L/∂·`` is known at the end of
the forward, so each chunk's ``∂loss/∂z`` (the formula in ``_function``, with per-token weight 1)
is formed right after the chunk's log-sum-exp, from the very logits the loss was read from, and
contracted at once (``_chunks.accumulate``):

    ∂L/∂h[chunk] = dz_CV @ W        (written into a preallocated [N, H] buffer)
    ∂L/∂W      += dz_CVᵀ @ h[chunk] (fp32 accumulator [V, H])
    ∂L/∂b      += Σ_rows dz_CV

That is three [chunk, H]×[H, V]-sized matmuls per chunk, as many as the naive loss, against four
for the recompute path. Saved for backward are only these three gradients — exactly the sizes
of hidden, weight and bias, never anything [N, V] — and the backward multiplies them by ``g``
in place (a second backward through the same graph therefore raises).

Vocab-parallel (TP): a shard's ``∂loss/∂z`` needs the chunk's GLOBAL log-sum-exp, so after the
chunk's logits each rank computes its slice's ``max`` and ``Σ exp(z − max)`` and one all-gather
of [2, C] per chunk gives every rank the same global ``lse`` (``combine_lse``); the local logits
gradient is then exact for this slice's columns. ``∂W_r``/``∂b_r`` are local by construction;
each rank's ``∂h`` is the partial sum over its columns, all-reduced (SUM) once per call; the
target logit and logit sum (needed for the loss value only) are all-reduced once per call too.
Still three matmuls per chunk; one small collective per chunk plus two per call.
The result is exact for any ``g`` because ``L`` is a scalar; it does not apply to
``reduction="none"`` (a per-token upstream gradient is unknown in the forward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from chunked_loss._checks import forbid_double_backward
from chunked_loss._chunks import Blocks, Rows, Spec, grad_buffers
from chunked_loss._kernels import dlogits_, row_stats, softmax_dlogits_
from chunked_loss._matmul import accumulate, chunk_logits
from chunked_loss._vocab_parallel import combine_lse

__all__ = ["FusedLinearCrossEntropyFunction"]


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """``(hidden [N, H], weight [V_r, H], bias [V_r] | None, labels [N], spec) -> Σ_i loss_i``
    fp32 scalar (ignored tokens contribute 0), gradients computed during the forward.

    Double backward raises.
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, labels_N, spec: Spec):
        local_vocab = weight_VH.shape[0]
        rows = Rows.of(labels_N, spec, local_vocab)
        device = hidden_NH.device
        lse_M = torch.zeros(len(rows), device=device)
        target_M = torch.zeros_like(lse_M)
        zsum_M = torch.zeros_like(lse_M)
        ones_M = torch.ones_like(lse_M)
        grads = grad_buffers(hidden_NH, weight_VH, *ctx.needs_input_grad[:3])
        blocks = Blocks(local_vocab, device)
        for s, e in rows.chunks(spec.chunk_size):
            rows_C, col_C, tw_C = rows.index_M[s:e], rows.col_M[s:e], rows.tw_M[s:e]
            hidden_CH = hidden_NH.index_select(0, rows_C)
            logits_CV = None
            if local_vocab > 0:
                logits_CV = chunk_logits(blocks.get(e - s), hidden_CH, weight_VH, bias_V)
            if spec.group is None:
                lse_C, target_C, zsum_C = softmax_dlogits_(
                    logits_CV, col_C, tw_C, ones_M[s:e], spec.smooth, spec.compiled
                )
            else:
                if logits_CV is None:  # empty vocabulary slice: still joins the collective
                    max_C = torch.full((e - s,), -torch.inf, device=device)
                    sumexp_C, target_C, zsum_C = (torch.zeros_like(max_C) for _ in range(3))
                else:
                    max_C, sumexp_C, target_C, zsum_C = row_stats(logits_CV, col_C, spec.compiled)
                lse_C = combine_lse(max_C, sumexp_C, spec.group)
                if logits_CV is not None:
                    dlogits_(logits_CV, lse_C, col_C, tw_C, ones_M[s:e], spec.smooth, spec.compiled)
            lse_M[s:e] = lse_C
            target_M[s:e] = target_C
            if zsum_C is not None:
                zsum_M[s:e] = zsum_C
            if logits_CV is not None:
                accumulate(logits_CV, hidden_CH, rows_C, weight_VH, *grads)
        del blocks
        grad_h, grad_w32, grad_b32 = grads
        target_M = torch.where(rows.here_M, target_M, 0.0)
        if spec.group is not None:
            stats_2M = torch.stack([target_M, zsum_M])
            dist.all_reduce(stats_2M, op=dist.ReduceOp.SUM, group=spec.group)
            target_M, zsum_M = stats_2M.unbind(0)
            if grad_h is not None:
                dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=spec.group)
        grad_w = None if grad_w32 is None else grad_w32.to(weight_VH.dtype)
        grad_b = None if grad_b32 is None else grad_b32.to(bias_V.dtype)
        del grad_w32, grad_b32
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return (lse_M - spec.keep * target_M - spec.smooth * zsum_M).sum()

    @staticmethod
    def backward(ctx, grad):
        forbid_double_backward("linear_cross_entropy")
        if getattr(ctx, "scaled", False):
            raise RuntimeError(
                "linear_cross_entropy with grad_in_forward=True was backpropagated twice "
                "(retain_graph=True): its saved gradients were already scaled in place by the "
                "first backward; use grad_in_forward=False to backpropagate one loss repeatedly"
            )
        ctx.scaled = True
        # In place: the saved buffers are released after this call, so autograd can hand them to
        # ``.grad`` as they are, with no second [V, H] / [N, H] allocation.
        grads = [None if g is None else g.mul_(grad.to(g.dtype)) for g in ctx.saved_tensors]
        return *grads, None, None
