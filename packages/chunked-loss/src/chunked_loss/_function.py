"""The chunked linear cross-entropy whose backward recomputes each chunk (recompute path).

This path serves ``reduction="none"`` (its per-token upstream gradient is unknown in the
forward) and ``grad_in_forward=False``; scalar losses default to ``_fused``, which forms the same
gradients during the forward.

Per token ``i`` with logits ``z_i = W h_i + b`` (length V), target ``t_i`` and smoothing ``ε``,
``F.cross_entropy`` computes

    loss_i = lse_i - (1 - ε) z_{i,t_i} - (ε / V) Σ_v z_{i,v},      lse_i = log Σ_v exp z_{i,v}
    ∂loss_i/∂z_{i,v} = softmax(z_i)_v - (1 - ε) [v = t_i] - ε / V

and 0 (with zero gradient) for an ignored token. Every quantity is a per-row reduction of
``z_i``, so the valid rows can be processed in chunks (``_chunks``): the forward keeps only
``lse`` ([M] fp32 for the M valid tokens) and the per-token loss; the backward recomputes one
[chunk, V] block of logits at a time from the saved inputs, turns it in place into ``∂loss/∂z``
scaled by the incoming per-token gradient and contracts it with ``W`` (→ ∂h) and ``h`` (→ ∂W,
accumulated in fp32). Nothing of size [N, V] is ever allocated or saved; the fp32 block exists
for one chunk only. Four matmuls per chunk: one in the forward, three in the backward.

Vocab-parallel: when each rank holds rows ``[start, start + V_r)`` of ``W`` (and ``b``), the row
statistics decompose over the vocabulary shards: ``lse = log Σ_r exp lse_r`` (combined stably
with an all-reduce MAX then SUM), the target logit lives on exactly one shard (the others
contribute 0 to an all-reduce SUM), and ``Σ_v z_v`` is a sum over shards. ``∂loss/∂z`` of a
shard's columns needs only the global ``lse``, so ``∂W_r`` and ``∂b_r`` stay local, while each
rank's ``∂h`` is a partial sum over its columns: one all-reduce SUM of [N, H] in backward makes
it the full gradient on every TP rank (hidden is replicated over TP). Two small all-reduces in
forward ([M] and [3, M]), one in backward, independent of the number of chunks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from chunked_loss._checks import forbid_double_backward
from chunked_loss._chunks import Blocks, Rows, Spec, grad_buffers
from chunked_loss._kernels import dlogits_, row_stats
from chunked_loss._matmul import accumulate, chunk_logits
from chunked_loss._vocab_parallel import combine_shards

__all__ = ["LinearCrossEntropyFunction"]


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``(hidden [N, H], weight [V_r, H], bias [V_r] | None, labels [N], spec) -> loss [N]`` fp32.

    Ignored tokens get loss 0 and zero gradient. Double backward raises: the backward is
    hand-written and not itself differentiable.
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, labels_N, spec: Spec):
        local_vocab = weight_VH.shape[0]
        rows = Rows.of(labels_N, spec, local_vocab)
        lse_M = torch.full((len(rows),), -torch.inf, device=hidden_NH.device)
        target_M = torch.zeros_like(lse_M)
        zsum_M = torch.zeros_like(lse_M)
        blocks = Blocks(local_vocab, hidden_NH.device)
        if local_vocab > 0:
            for s, e in rows.chunks(spec.chunk_size):
                hidden_CH = hidden_NH.index_select(0, rows.index_M[s:e])
                logits_CV = chunk_logits(blocks.get(e - s), hidden_CH, weight_VH, bias_V)
                max_C, sumexp_C, target_C, zsum_C = row_stats(
                    logits_CV, rows.col_M[s:e], spec.compiled
                )
                lse_M[s:e] = max_C + sumexp_C.log()
                target_M[s:e] = target_C
                zsum_M[s:e] = zsum_C
        del blocks
        target_M = torch.where(rows.here_M, target_M, 0.0)
        if spec.group is not None and len(rows) > 0:
            lse_M, target_M, zsum_M = combine_shards(lse_M, target_M, zsum_M, spec.group)
        loss_M = lse_M - spec.keep * target_M - spec.smooth * zsum_M
        ctx.spec = spec
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, labels_N, lse_M)
        loss_N = torch.zeros(labels_N.shape[0], device=hidden_NH.device)
        return loss_N.index_copy_(0, rows.index_M, loss_M)

    @staticmethod
    def backward(ctx, grad_N):
        forbid_double_backward("linear_cross_entropy")
        hidden_NH, weight_VH, bias_V, labels_N, lse_M = ctx.saved_tensors
        spec: Spec = ctx.spec
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        local_vocab = weight_VH.shape[0]
        rows = Rows.of(labels_N, spec, local_vocab)
        scale_M = grad_N.float().index_select(0, rows.index_M)
        grads = grad_buffers(hidden_NH, weight_VH, need_h, need_w, need_b)
        blocks = Blocks(local_vocab, hidden_NH.device)
        if local_vocab > 0 and (need_h or need_w or need_b):
            for s, e in rows.chunks(spec.chunk_size):
                rows_C = rows.index_M[s:e]
                hidden_CH = hidden_NH.index_select(0, rows_C)
                dz_CV = dlogits_(
                    chunk_logits(blocks.get(e - s), hidden_CH, weight_VH, bias_V),
                    lse_M[s:e],
                    rows.col_M[s:e],
                    rows.tw_M[s:e],
                    scale_M[s:e],
                    spec.smooth,
                    spec.compiled,
                )
                accumulate(dz_CV, hidden_CH, rows_C, weight_VH, *grads)
        del blocks
        grad_h, grad_w32, grad_b32 = grads
        if need_h and spec.group is not None:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=spec.group)
        grad_w = grad_w32.to(weight_VH.dtype) if need_w else None
        grad_b = grad_b32.to(bias_V.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None
