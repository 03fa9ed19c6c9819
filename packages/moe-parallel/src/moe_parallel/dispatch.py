"""Dropless token dispatch to expert-owning ranks and back, with autograd.

Rank ``r`` of an EP group of size P owns experts ``[r*L, (r+1)*L)`` (L = E / P). Each rank
sorts its (token, slot) rows by expert, so the rows for rank ``q`` are one contiguous block:

1. the [P, L] per-expert row counts are exchanged (an equal-split all-to-all of integers);
2. rows go to their owners with an uneven ``all_to_all_single`` (gloo's list form rejects
   unequal sizes); the receiver regroups them expert-major and runs one grouped GEMM;
3. outputs go back with the transposed splits and land in the sender's original row order.

Both exchanges are ``all_to_all_single_autograd``: the backward of step 2 sends each row's
input gradient from the expert owner back to the rank that sent the row, and the backward of
step 3 sends each output-row gradient from the home rank to the expert owner. Nothing is scaled
or dropped, and every rank runs its experts even on zero rows, so the result and all gradients
equal the single-process computation, and an idle expert gets a zero gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

__all__ = ["all_to_all_expert_compute", "dispatch_splits"]


def dispatch_splits(counts_E: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Per-expert counts [E] → [P, L] counts for the P ranks, each owning L consecutive experts."""
    if counts_E.numel() % ep_size:
        raise ValueError(f"EP size {ep_size} must divide the {counts_E.numel()} experts")
    return counts_E.view(ep_size, -1)


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t


def all_to_all_expert_compute(
    x_sorted_MH: torch.Tensor,
    counts_E: torch.Tensor,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Send rows to their experts' ranks, run ``compute`` there, bring the outputs home.

    Args:
        x_sorted_MH: [M, H] this rank's rows sorted by global expert id.
        counts_E: [E] int64 rows per global expert (sums to M).
        compute: ``(rows [R, H] grouped by local expert, counts [L]) -> [R, H']``.
        group: the EP process group (rank r owns experts r*L .. r*L+L-1).

    Returns:
        [M, H'] outputs in the order of ``x_sorted_MH``.

    Backward: the output gradient [M, H'] goes to the expert owners (all-to-all with the
    forward-receive splits), ``compute``'s backward runs there, and the row gradients come back
    to this rank (all-to-all with the forward-send splits).
    """
    ep_size = dist.get_world_size(group)
    send_PL = dispatch_splits(counts_E, ep_size).contiguous()
    recv_PL = torch.empty_like(send_PL)
    dist.all_to_all_single(recv_PL, send_PL, group=group)
    send_splits = send_PL.sum(1).tolist()
    recv_splits = recv_PL.sum(1).tolist()
    x_recv = _waited(fc.all_to_all_single_autograd(x_sorted_MH, recv_splits, send_splits, group))
    local_experts = send_PL.shape[1]
    expert_of_row = torch.arange(local_experts).repeat(ep_size)
    expert_of_row = torch.repeat_interleave(expert_of_row, recv_PL.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True).to(x_recv.device)
    # index_select (a permutation both ways): its backward adds rows in a fixed order
    y_rows = compute(x_recv.index_select(0, by_expert), recv_PL.sum(0))
    y_recv = y_rows.index_select(0, torch.argsort(by_expert))
    return _waited(fc.all_to_all_single_autograd(y_recv, send_splits, recv_splits, group))
