"""Bring each rank the rows of other ranks' per-token tensors that its pieces depend on.

A piece ``[s, e)`` of document ``d`` depends on the document's earlier tokens ``[0, s)`` (for
attention: their keys and values). The layout is known to every rank, so every rank computes
the same plan: who sends which of its local rows to whom, in global token order. Two
transports, chosen from the layout alone (hence identically on every rank):

- ``pieces``: one uneven ``all_to_all_single`` carrying exactly the needed rows;
- ``all_gather``: every rank's rows to every rank (cheaper to launch when nearly everything is
  needed anyway, e.g. one document spread over all ranks).

Both go through torch's functional collectives with autograd: the backward of the all-to-all
is the reverse all-to-all and that of the all-gather a reduce-scatter, so the gradient of a row
is summed over every rank that used it and lands on the row's owner — exact, no hand-written
backward.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as fc

from cp_varlen_attn.layout import CPLayout

__all__ = ["ExchangePlan", "all_gather_autograd", "exchange_rows", "plan_exchange"]

# torch 2.15 renamed the autograd all-gather; the package supports torch >= 2.9.
all_gather_autograd = (
    getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
)

# Use the all-gather when the needed rows reach this fraction of what an all-gather moves.
ALL_GATHER_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """For one rank: what to send, what arrives, and where every global row ends up.

    ``row_of`` [S] int64: for each global position, its row in the buffer that
    :func:`exchange_rows` returns (local rows first), or -1 when this rank never sees it.
    """

    transport: str
    send_index: torch.Tensor  # local rows to send, grouped by destination rank
    send_counts: list[int]
    recv_counts: list[int]
    row_of: torch.Tensor
    gather_width: int = 0  # all_gather: every rank's rows padded to the longest local length


@functools.lru_cache(maxsize=16)
def plan_exchange(layout: CPLayout, rank: int, causal: bool = True) -> ExchangePlan:
    """The exchange plan of ``rank`` (cached per layout: layouts are immutable). Causal
    pieces depend on their document's earlier tokens, non-causal ones on all of it."""
    cp, seq = layout.cp_size, layout.seq_len
    needed = [_needed_positions(layout, r, causal) for r in range(cp)]
    if cp > 1 and sum(n.numel() for n in needed) >= ALL_GATHER_FRACTION * sum(
        layout.all_gather_kv_bytes(1)
    ):
        return _all_gather_plan(layout, rank)
    owner = torch.empty(seq, dtype=torch.long)
    local_row = torch.empty(seq, dtype=torch.long)
    for r in range(cp):
        pos = layout.positions(r)
        owner[pos] = r
        local_row[pos] = torch.arange(pos.numel())
    mine = layout.positions(rank)
    send_parts = []
    for dest in range(cp):
        want = needed[dest]
        send_parts.append(local_row[want[owner[want] == rank]] if dest != rank else want[:0])
    want = needed[rank]
    recv_parts = [want[owner[want] == src] if src != rank else want[:0] for src in range(cp)]
    row_of = torch.full((seq,), -1, dtype=torch.long)
    row_of[mine] = torch.arange(mine.numel())
    arrived = torch.cat(recv_parts)
    row_of[arrived] = torch.arange(mine.numel(), mine.numel() + arrived.numel())
    return ExchangePlan(
        "pieces",
        torch.cat(send_parts),
        [p.numel() for p in send_parts],
        [p.numel() for p in recv_parts],
        row_of,
    )


def _all_gather_plan(layout: CPLayout, rank: int) -> ExchangePlan:
    width = max(layout.local_len(r) for r in range(layout.cp_size))
    row_of = torch.full((layout.seq_len,), -1, dtype=torch.long)
    for r in range(layout.cp_size):
        pos = layout.positions(r)
        row_of[pos] = r * width + torch.arange(pos.numel())
    return ExchangePlan("all_gather", torch.zeros(0, dtype=torch.long), [], [], row_of, width)


def _needed_positions(layout: CPLayout, rank: int, causal: bool) -> torch.Tensor:
    """Global positions of other ranks' tokens that ``rank``'s pieces depend on, ascending."""
    last_end: dict[int, int] = {}
    for p in layout.pieces[rank]:
        end = p.end if causal else layout.cu_seqlens[p.doc + 1] - layout.doc_start(p.doc)
        last_end[p.doc] = max(last_end.get(p.doc, 0), end)
    mine = torch.zeros(layout.seq_len, dtype=torch.bool)
    mine[layout.positions(rank)] = True
    parts = [
        torch.arange(layout.doc_start(d), layout.doc_start(d) + e)
        for d, e in sorted(last_end.items())
    ]
    cand = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return cand[~mine[cand]]


def exchange_rows(
    local_TF: torch.Tensor, plan: ExchangePlan, group: dist.ProcessGroup
) -> torch.Tensor:
    """[T_local, F] → the buffer [R, F] indexed by ``plan.row_of`` (differentiable)."""
    if plan.transport == "all_gather":
        padded = torch.nn.functional.pad(local_TF, (0, 0, 0, plan.gather_width - local_TF.shape[0]))
        return all_gather_autograd(padded.contiguous(), gather_dim=0, group=group)
    sent = local_TF.index_select(0, plan.send_index.to(local_TF.device)).contiguous()
    received = fc.all_to_all_single_autograd(sent, plan.recv_counts, plan.send_counts, group=group)
    return torch.cat([local_TF, received], 0)
