"""Split identical tokens across TP ranks before expert dispatch, gather the outputs after.

TP ranks hold the same tokens. If every TP rank dispatched all of them into an EP group that
contains the other TP ranks, each expert would see every token tp times and its gradient would be
tp× too large. Instead TP rank r takes the contiguous row block
``[r*c, min((r+1)*c, N))`` (c = ceil(N / tp), the last blocks may be short or empty), so each
token is dispatched exactly once and expert gradients are exact by construction.

The pair of autograd functions follows the TP convention that a replicated activation carries
the full (identical) gradient on every TP rank:

- :class:`SliceRows`: forward takes this rank's rows; backward all-gathers the row gradients so
  every rank gets the full input gradient.
- :class:`GatherRows`: forward all-gathers the row blocks into the full [N, ...] tensor;
  backward keeps this rank's block of the (identical) output gradient; nothing is summed, so
  nothing is counted twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["GatherRows", "SliceRows", "row_block"]


def row_block(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rows [lo, hi) of ``n`` that TP rank ``rank`` of ``size`` handles."""
    chunk = -(-n // size)
    return min(rank * chunk, n), min((rank + 1) * chunk, n)


def _all_gather_rows(block: torch.Tensor, n: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    chunk = -(-n // size)
    padded = block.new_zeros((chunk, *block.shape[1:]))
    padded[: block.shape[0]] = block
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat(parts)[:n]


class SliceRows(torch.autograd.Function):
    """x [N, ...] (identical on the TP group) → this rank's rows; backward all-gathers grads."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.n = group, x.shape[0]
        lo, hi = row_block(x.shape[0], dist.get_rank(group), dist.get_world_size(group))
        return x[lo:hi]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_rows(grad, ctx.n, ctx.group), None


class GatherRows(torch.autograd.Function):
    """This rank's rows → the full [N, ...] on every TP rank; backward keeps this rank's rows."""

    @staticmethod
    def forward(ctx, block: torch.Tensor, n: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.lo, ctx.hi = row_block(n, dist.get_rank(group), dist.get_world_size(group))
        return _all_gather_rows(block, n, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.lo : ctx.hi], None, None
