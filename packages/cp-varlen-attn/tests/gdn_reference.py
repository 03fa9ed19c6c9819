"""Independent references for the gated-delta-rule and conv tests: a token-by-token recurrence
per document, and ``F.conv1d`` per document."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def naive_gated_delta(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, l2norm=True):
    """q, k [T, H_k, K]; v [T, H_v, V]; g, beta [T, H_v]; → out [T, H_v, V], finals [N, H_v, K, V].

    One token: S ← exp(g)·S; S ← S + β·k·(v − Sᵀk)ᵀ; o = Sᵀ(scale·q), per document from its own state.
    """
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    outs, finals = [], []
    for d, (s, e) in enumerate(itertools.pairwise(cu_seqlens)):
        S = (
            initial_state[d]
            if initial_state is not None
            else v.new_zeros(v.shape[1], q.shape[-1], v.shape[-1])
        )
        for t in range(s, e):
            S = S * g[t].exp()[:, None, None]
            pred = torch.einsum("hkv,hk->hv", S, k[t])
            S = S + beta[t][:, None, None] * torch.einsum("hk,hv->hkv", k[t], v[t] - pred)
            outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
        finals.append(S)
    return torch.stack(outs), torch.stack(finals)


def conv_per_document(x_TC, weight_CK, bias, cu_seqlens, activation="silu"):
    """Depthwise causal conv of each document on its own (left zero padding), via F.conv1d."""
    outs = []
    c, kernel = weight_CK.shape
    for s, e in itertools.pairwise(cu_seqlens):
        y = F.conv1d(
            x_TC[s:e].T.unsqueeze(0), weight_CK.unsqueeze(1), bias, padding=kernel - 1, groups=c
        )
        outs.append(y[0, :, : e - s].T)
    out = torch.cat(outs)
    return F.silu(out) if activation == "silu" else out


def cu_from_lengths(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu
