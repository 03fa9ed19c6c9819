"""Small test models with gated-delta-rule layers (shared by the test modules)."""

from __future__ import annotations

import torch
from torch import nn


class TinyGDN(nn.Module):
    """An integration-style GDN layer: the Qwen3.5 parameter layout and size attributes, with a
    forward that calls ``kernel`` on the q/k/v/g/beta it builds (so a test can record them)."""

    def __init__(self, hidden: int, hk: int, hv: int, dk: int, dv: int, kernel=None):
        super().__init__()
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = hk, hv, dk, dv
        self.in_proj_qkv = nn.Linear(hidden, 2 * hk * dk + hv * dv, bias=False)
        self.in_proj_z = nn.Linear(hidden, hv * dv, bias=False)
        self.in_proj_a = nn.Linear(hidden, hv, bias=False)
        self.in_proj_b = nn.Linear(hidden, hv, bias=False)
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.out_proj = nn.Linear(hv * dv, hidden, bias=False)
        self.kernel = kernel

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        b, t, _ = hidden_BTH.shape
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        q, k, v = self.in_proj_qkv(hidden_BTH).split([hk * dk, hk * dk, hv * dv], dim=-1)
        g = -self.A_log.float().exp() * nn.functional.softplus(
            self.in_proj_a(hidden_BTH).float() + self.dt_bias
        )
        beta = self.in_proj_b(hidden_BTH).sigmoid()
        out, _ = self.kernel(
            q.reshape(b, t, hk, dk), k.reshape(b, t, hk, dk), v.reshape(b, t, hv, dv), g, beta
        )
        return self.out_proj(out.reshape(b, t, hv * dv))


class MambaLike(nn.Module):
    """Has A_log and dt_bias like a GDN layer, but none of its projections or size attributes."""

    def __init__(self):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(4))
        self.dt_bias = nn.Parameter(torch.zeros(4))
        self.in_proj = nn.Linear(8, 8)
        self.num_heads = 4


class Block(nn.Module):
    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.linear_attn = mixer
        self.mlp = nn.Linear(8, 8)


def naive_gated_delta_rule(q, k, v, g, beta, *, use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Token-by-token gated delta rule (fla's call signature, GVA by repeating q/k heads).

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; cu_seqlens [N+1] with B == 1.
    Returns (o [B, T, Hv, Dv], None).
    """
    b, t, hk, dk = q.shape
    hv, out_dtype = v.shape[2], v.dtype
    if use_qk_l2norm_in_kernel:
        q, k = nn.functional.normalize(q, dim=-1), nn.functional.normalize(k, dim=-1)
    q = q.float().repeat_interleave(hv // hk, dim=2) * dk**-0.5
    k = k.float().repeat_interleave(hv // hk, dim=2)
    v, beta = v.float(), beta.float()
    starts = set(range(0, t + 1, t)) if cu_seqlens is None else set(cu_seqlens.tolist())
    outs = []
    for bi in range(b):
        state = None
        rows = []
        for ti in range(t):
            if ti in starts or state is None:
                state = q.new_zeros(hv, dk, v.shape[-1])
            state = state * g[bi, ti].exp()[:, None, None]
            kt, vt = k[bi, ti], v[bi, ti]
            err = vt - torch.einsum("hkv,hk->hv", state, kt)
            state = state + beta[bi, ti][:, None, None] * torch.einsum("hk,hv->hkv", kt, err)
            rows.append(torch.einsum("hkv,hk->hv", state, q[bi, ti]))
        outs.append(torch.stack(rows))
    return torch.stack(outs).to(out_dtype), None
