"""A CPU stand-in for ``transformer_engine.pytorch.GroupedLinear`` with TE's zero-row hazard.

It has the interface the TE backend relies on (constructor arguments, one ``weight{e}``
parameter per GEMM read with ``getattr`` at forward, ``forward(inp, m_splits)``), computes
``x_e @ W_e^T`` per row block exactly, and, like TE, fills the weight gradient of a grouped GEMM
into one uninitialised buffer: a GEMM with zero rows never writes its slice. Here that slice is
NaN (TE's ``torch.empty`` holds arbitrary memory), so a missing guard cannot go unnoticed.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from torch import nn


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MI, m_splits, *weights):
        ctx.m_splits = m_splits
        ctx.save_for_backward(x_MI, *weights)
        blocks = x_MI.split(m_splits)
        return torch.cat([F.linear(x_e, w) for x_e, w in zip(blocks, weights, strict=True)])

    @staticmethod
    def backward(ctx, grad_MO):
        x_MI, *weights = ctx.saved_tensors
        wgrad_packed = torch.full((len(weights), *weights[0].shape), float("nan"))
        dgrad = []
        blocks = zip(x_MI.split(ctx.m_splits), grad_MO.split(ctx.m_splits), weights, strict=True)
        for e, (x_e, g_e, w) in enumerate(blocks):
            if x_e.shape[0]:
                wgrad_packed[e] = g_e.T @ x_e
            dgrad.append(g_e @ w)
        return (torch.cat(dgrad), None, *wgrad_packed.unbind(0))


class GroupedLinear(nn.Module):
    """``GroupedLinear(num_gemms, in_features, out_features, bias=..., params_dtype=..., device=...)``."""

    def __init__(
        self, num_gemms, in_features, out_features, bias=True, params_dtype=None, device="cuda"
    ):
        super().__init__()
        if bias:
            raise NotImplementedError("the stand-in has no bias")
        self.num_gemms = num_gemms
        for e in range(num_gemms):
            weight = torch.empty(out_features, in_features, dtype=params_dtype, device=device)
            self.register_parameter(f"weight{e}", nn.Parameter(weight))

    def forward(self, inp, m_splits):
        weights = [getattr(self, f"weight{e}") for e in range(self.num_gemms)]
        return _GroupedGemm.apply(inp, list(m_splits), *weights)


def modules() -> dict[str, types.ModuleType]:
    """``sys.modules`` entries that make ``import transformer_engine.pytorch`` give the stand-in."""
    root = types.ModuleType("transformer_engine")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.GroupedLinear = GroupedLinear
    root.pytorch = pytorch
    return {"transformer_engine": root, "transformer_engine.pytorch": pytorch}


def install() -> None:
    """Install the stand-in process-wide (for spawned test ranks)."""
    sys.modules.update(modules())
