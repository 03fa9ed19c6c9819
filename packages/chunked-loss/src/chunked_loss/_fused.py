"""Gradient-in-forward fused linear cross-entropy for a scalar (summed) loss.

When the loss is a scalar ``L = Σ_i loss_i`` (``reduction="sum"``, and ``"mean"``, which is that
sum divided by a constant outside this function), its gradients for any upstream scalar
gradient ``g`` are ``g · ∂L/∂h``, ``g · ∂L/∂W`` and ``g · ∂L/∂b``. Everything in ``∂L/∂·`` is
known at the end of the forward, so each chunk's ``∂loss/∂z`` (the formula in ``_function``,
with per-token weight 1, or 0 where ignored) is formed right after the chunk's log-sum-exp, from
the very logits the loss was read from, and contracted at once:

    ∂L/∂h[chunk] = dz_CV @ W        (written into a preallocated [N, H] buffer)
    ∂L/∂W      += dz_CVᵀ @ h[chunk] (fp32 accumulator [V, H])
    ∂L/∂b      += Σ_rows dz_CV

That is three [chunk, H]×[H, V]-sized matmuls per chunk, as many as the naive loss, against four
for the recompute path. Saved for backward are only these three gradients — exactly the sizes
of hidden, weight and bias, never anything [N, V] — and the backward multiplies them by ``g``
in place (a second backward through the same graph therefore raises).
The result is exact for any ``g`` because ``L`` is a scalar; it does not apply to
``reduction="none"`` (a per-token upstream gradient is unknown in forward) nor to the
vocab-parallel path, where ``∂loss/∂z`` needs the global log-sum-exp (see ``linear``).
"""

from __future__ import annotations

import torch

from chunked_loss._checks import forbid_double_backward
from chunked_loss._function import Spec, grad_buffers, logits_fp32, probs_to_dlogits_, targets

__all__ = ["FusedLinearCrossEntropyFunction"]


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], bias [V] | None, labels [N], spec) -> Σ_i loss_i`` fp32
    scalar (ignored tokens contribute 0), gradients computed during the forward.

    The whole vocabulary on this process (``linear`` never routes a vocab-parallel call here).
    Double backward raises.
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, labels_N, spec: Spec):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n_tokens, vocab = hidden_NH.shape[0], weight_VH.shape[0]
        eps = spec.label_smoothing
        valid_N, here_N, col_N = targets(labels_N, spec, vocab)
        weight_N = valid_N.float()
        loss_N = torch.zeros(n_tokens, dtype=torch.float32, device=hidden_NH.device)
        grad_h, grad_w32, grad_b32 = grad_buffers(hidden_NH, weight_VH, need_h, need_w, need_b)
        if vocab > 0:
            for s in range(0, n_tokens, spec.chunk_size):
                e = min(s + spec.chunk_size, n_tokens)
                hidden_CH = hidden_NH[s:e]
                logits_CV = logits_fp32(hidden_CH, weight_VH, bias_V)
                loss_C = (eps - 1.0) * logits_CV.gather(1, col_N[s:e, None]).squeeze(1)
                if eps > 0.0:
                    loss_C -= (eps / spec.vocab_total) * logits_CV.sum(dim=-1)
                # Softmax in the logits' own buffer (no logsumexp temporary, one exp pass):
                # lse = max + log Σ exp(z − max), softmax = exp(z − max) / Σ exp(z − max).
                max_C = logits_CV.amax(dim=-1)
                probs_CV = logits_CV.sub_(max_C[:, None]).exp_()
                sum_C = probs_CV.sum(dim=-1)
                loss_N[s:e] = loss_C + max_C + sum_C.log()
                dz_CV = probs_to_dlogits_(
                    probs_CV.div_(sum_C[:, None]), here_N[s:e], col_N[s:e], weight_N[s:e], spec
                )
                if need_h:
                    grad_h[s:e] = dz_CV.to(weight_VH.dtype) @ weight_VH
                if need_w:
                    grad_w32.addmm_(dz_CV.t(), hidden_CH.float())
                if need_b:
                    grad_b32 += dz_CV.sum(dim=0)
                del logits_CV, probs_CV, dz_CV
        grad_w = grad_w32.to(weight_VH.dtype) if need_w else None
        grad_b = grad_b32.to(bias_V.dtype) if need_b else None
        del grad_w32, grad_b32
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return torch.where(valid_N, loss_N, 0.0).sum()

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
