"""Independent references for the tests: per-document attention on the whole packed sequence."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def per_document_attention(q_THD, k_THD, v_THD, cu_seqlens, *, causal=True, scale=None):
    """Each cu_seqlens segment attends only to itself (SDPA's own causal mask per segment)."""
    outs = []
    for s, e in itertools.pairwise(cu_seqlens):
        q = q_THD[s:e].transpose(0, 1)
        k = k_THD[s:e].transpose(0, 1)
        v = v_THD[s:e].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[0] != k.shape[0]
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, 0)


def cu_from_lengths(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu
