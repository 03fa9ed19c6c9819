"""The chunked fused linear cross-entropy as one ``torch.autograd.Function`` (recompute path).

This path serves ``reduction="none"``, the vocab-parallel path and ``grad_in_forward=False``;
scalar losses default to ``_fused``, which forms the same gradients during the forward.

Per token ``i`` with logits ``z_i = W h_i + b`` (length V), target ``t_i`` and smoothing ``ε``,
``F.cross_entropy`` computes

    loss_i = lse_i - (1 - ε) z_{i,t_i} - (ε / V) Σ_v z_{i,v},      lse_i = log Σ_v exp z_{i,v}
    ∂loss_i/∂z_{i,v} = softmax(z_i)_v - (1 - ε) [v = t_i] - ε / V

and 0 (with zero gradient) for an ignored token. Every quantity is a per-row reduction of
``z_i``, so the rows can be processed in chunks of ``chunk_size`` tokens: the forward keeps only
``lse`` ([N] fp32) and the per-token loss; the backward recomputes one [chunk, V] block of logits
at a time from the saved inputs, turns it in place into ``∂loss/∂z`` (scaled by the incoming
per-token gradient) and contracts it with ``W`` (→ ∂h) and ``h`` (→ ∂W, accumulated in fp32).
Nothing of size [N, V] is ever allocated or saved; the fp32 upcast exists for one chunk only.

Vocab-parallel: when each rank holds rows ``[start, start + V_r)`` of ``W`` (and ``b``), the row
statistics decompose over the vocabulary shards: ``lse = log Σ_r exp lse_r`` (combined stably
with an all-reduce MAX then SUM), the target logit lives on exactly one shard (the others
contribute 0 to an all-reduce SUM), and ``Σ_v z_v`` is a sum over shards. ``∂loss/∂z`` of a
shard's columns needs only the global ``lse``, so ``∂W_r`` and ``∂b_r`` stay local, while each
rank's ``∂h`` is a partial sum over its columns: one all-reduce SUM of [N, H] in backward makes
it the full gradient on every TP rank (hidden is replicated over TP). Two small all-reduces in
forward ([N] and [3, N]), one in backward, independent of the number of chunks.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from chunked_loss._checks import forbid_double_backward

__all__ = [
    "LinearCrossEntropyFunction",
    "Spec",
    "dlogits_",
    "logits_fp32",
    "probs_to_dlogits_",
    "targets",
]


@dataclasses.dataclass(frozen=True)
class Spec:
    """Non-tensor options. ``vocab_start``/``vocab_total`` locate this rank's weight rows in the
    full vocabulary; ``group`` is the TP group the vocabulary is split over (None: not split)."""

    ignore_index: int
    label_smoothing: float
    chunk_size: int
    vocab_start: int
    vocab_total: int
    group: dist.ProcessGroup | None = None


def logits_fp32(
    hidden_CH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None
) -> torch.Tensor:
    """One chunk of logits in fp32, a fresh tensor the caller may overwrite."""
    logits_CV = F.linear(hidden_CH, weight_VH, bias_V)
    return logits_CV if logits_CV.dtype == torch.float32 else logits_CV.float()


def probs_to_dlogits_(probs_CV, here_C, col_C, scale_C, spec: Spec) -> torch.Tensor:
    """Turn one fp32 chunk of softmax probabilities, in place, into ``scale · ∂loss/∂z``:
    ``softmax − ε/V − (1 − ε)·onehot`` (the one-hot only where this shard holds the target,
    without a host sync), each row times ``scale_C`` (0 for ignored tokens)."""
    eps = spec.label_smoothing
    if eps > 0.0:
        probs_CV.sub_(eps / spec.vocab_total)
    hit_C1 = here_C[:, None].to(probs_CV.dtype).mul_(eps - 1.0)
    probs_CV.scatter_add_(1, col_C[:, None], hit_C1)
    return probs_CV.mul_(scale_C[:, None])


def dlogits_(logits_CV, lse_C, here_C, col_C, scale_C, spec: Spec) -> torch.Tensor:
    """``probs_to_dlogits_`` of ``softmax = exp(logits − lse)``, all in the logits' buffer."""
    probs_CV = logits_CV.sub_(lse_C[:, None]).exp_()
    return probs_to_dlogits_(probs_CV, here_C, col_C, scale_C, spec)


def grad_buffers(hidden_NH, weight_VH, need_h: bool, need_w: bool, need_b: bool):
    """Zeroed gradient accumulators: hidden in its own dtype, weight and bias in fp32 (None where
    no gradient is needed)."""
    grad_h = torch.zeros_like(hidden_NH) if need_h else None
    f32 = {"dtype": torch.float32, "device": weight_VH.device}
    grad_w32 = torch.zeros(weight_VH.shape, **f32) if need_w else None
    grad_b32 = torch.zeros(weight_VH.shape[0], **f32) if need_b else None
    return grad_h, grad_w32, grad_b32


def targets(labels_N: torch.Tensor, spec: Spec, local_vocab: int):
    """valid_N: not ignored; here_N: the target column lies in this shard; col_N: its column."""
    valid_N = labels_N != spec.ignore_index
    col_N = labels_N.long() - spec.vocab_start
    here_N = valid_N & (col_N >= 0) & (col_N < local_vocab)
    return valid_N, here_N, torch.where(here_N, col_N, 0)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``(hidden [N, H], weight [V_r, H], bias [V_r] | None, labels [N], spec) -> loss [N]`` fp32.

    Ignored tokens get loss 0 and zero gradient. Double backward raises: the backward is
    hand-written and not itself differentiable.
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, labels_N, spec: Spec):
        n_tokens, local_vocab = hidden_NH.shape[0], weight_VH.shape[0]
        eps = spec.label_smoothing
        valid_N, here_N, col_N = targets(labels_N, spec, local_vocab)
        lse_N = torch.full((n_tokens,), -torch.inf, dtype=torch.float32, device=hidden_NH.device)
        target_N = torch.zeros_like(lse_N)
        zsum_N = torch.zeros_like(lse_N)
        if local_vocab > 0:
            for s in range(0, n_tokens, spec.chunk_size):
                e = min(s + spec.chunk_size, n_tokens)
                logits_CV = logits_fp32(hidden_NH[s:e], weight_VH, bias_V)
                lse_N[s:e] = torch.logsumexp(logits_CV, dim=-1)
                target_N[s:e] = logits_CV.gather(1, col_N[s:e, None]).squeeze(1)
                if eps > 0.0:
                    zsum_N[s:e] = logits_CV.sum(dim=-1)
                del logits_CV
        target_N = torch.where(here_N, target_N, 0.0)
        if spec.group is not None and n_tokens > 0:
            lse_N, target_N, zsum_N = combine_shards(lse_N, target_N, zsum_N, spec.group)
        loss_N = lse_N - (1.0 - eps) * target_N
        if eps > 0.0:
            loss_N = loss_N - (eps / spec.vocab_total) * zsum_N
        loss_N = torch.where(valid_N, loss_N, 0.0)
        ctx.spec = spec
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, labels_N, lse_N)
        return loss_N

    @staticmethod
    def backward(ctx, grad_N):
        forbid_double_backward("linear_cross_entropy")
        hidden_NH, weight_VH, bias_V, labels_N, lse_N = ctx.saved_tensors
        spec: Spec = ctx.spec
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n_tokens, local_vocab = hidden_NH.shape[0], weight_VH.shape[0]
        valid_N, here_N, col_N = targets(labels_N, spec, local_vocab)
        scale_N = torch.where(valid_N, grad_N.float(), 0.0)
        grad_h, grad_w32, grad_b32 = grad_buffers(hidden_NH, weight_VH, need_h, need_w, need_b)
        if local_vocab > 0 and (need_h or need_w or need_b):
            for s in range(0, n_tokens, spec.chunk_size):
                e = min(s + spec.chunk_size, n_tokens)
                hidden_CH = hidden_NH[s:e]
                dz_CV = dlogits_(
                    logits_fp32(hidden_CH, weight_VH, bias_V),
                    lse_N[s:e],
                    here_N[s:e],
                    col_N[s:e],
                    scale_N[s:e],
                    spec,
                )
                if need_h:
                    grad_h[s:e] = dz_CV.to(weight_VH.dtype) @ weight_VH
                if need_w:
                    grad_w32.addmm_(dz_CV.t(), hidden_CH.float())
                if need_b:
                    grad_b32 += dz_CV.sum(dim=0)
                del dz_CV
        if need_h and spec.group is not None:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=spec.group)
        grad_w = grad_w32.to(weight_VH.dtype) if need_w else None
        grad_b = grad_b32.to(bias_V.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None


def combine_shards(lse_N, target_N, zsum_N, group):
    """Full-vocabulary row statistics from per-shard ones: logsumexp over shards (max-shifted,
    an empty shard contributes lse = -inf, i.e. nothing), target logit and logit sum by SUM."""
    max_N = lse_N.clone()
    dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=group)
    max_N = torch.where(torch.isfinite(max_N), max_N, 0.0)
    stats_3N = torch.stack([torch.exp(lse_N - max_N), target_N, zsum_N])
    dist.all_reduce(stats_3N, op=dist.ReduceOp.SUM, group=group)
    return max_N + torch.log(stats_3N[0]), stats_3N[1], stats_3N[2]
