"""The two TP communications the TP-split Gated DeltaNet needs, as autograd functions (the
pair Megatron calls "copy to / reduce from the tensor-parallel region"):

- :func:`sum_grad_over_tp`: identity forward, the backward sums the gradient over the TP group —
  for a tensor every TP rank reads whole (a replicated weight, the layer's input), whose
  gradient is the sum of every rank's heads' contributions;
- :func:`sum_over_tp`: the forward sums partial results over the TP group (a row-parallel
  projection's output), the backward passes the replicated gradient through.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["sum_grad_over_tp", "sum_over_tp"]


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverTP(torch.autograd.Function):
    """Forward sums partial results over the TP group; backward passes the (replicated)
    gradient through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_grad_over_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x``; its gradient summed over ``group``."""
    return _SumGradOverTP.apply(x, group)


def sum_over_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over ``group``; the gradient passed through."""
    return _SumOverTP.apply(x, group)
