"""The gated delta rule under CP: affine piece summaries, one all-gather, a scan per document.

Per value head the state after a run of tokens is affine in the state before it:
``S_out = 𝒜·S_in + ℬ`` and every output is ``o_t = o_t⁰ + q̃_tᵀ·S_in`` with ``q̃_t = 𝒜_{≤t}ᵀ q_t``
(ALGORITHMS.md). A piece that does not start its document is therefore run ONCE from the
augmented state ``[I | 0]`` ∈ R^{K×(K+V)} with augmented values ``[0 | v]``: the first K
columns of its state evolve as ``𝒜_{≤t}`` and the last V as the zero-start state, so its final
state is ``[𝒜 | ℬ]`` and its outputs are ``[q̃_t | o_t⁰]`` — everything the correction needs.
A piece that starts its document knows its incoming state (the document's initial state, or
zero) and is run directly; its summary is ``(𝒜 = 0, ℬ = S_out)``.

Exchange: rank r2 needs the summary of every piece, held by another rank, that precedes one of
r2's pieces not starting its document. Those summaries, [H, K, K+V] each — independent of the
piece length — travel in one uneven ``all_to_all_single_autograd`` (the layout, identical on
every rank, fixes who sends what in which order). Each rank then scans the pieces of each of
its documents in order (``S ← 𝒜·S + ℬ``) to get every local piece's ``S_in`` and applies the
correction. The all-to-all's backward is the reverse all-to-all, so the gradient of a summary
from every rank that used it is summed on the summary's owner: autograd gives the exact
backward, including the state gradients handed back across ranks.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.distributed import _functional_collectives as fc

from cp_varlen_attn.layout import CPLayout

__all__ = ["SummaryPlan", "cp_gated_delta", "plan_summaries"]


@dataclasses.dataclass(frozen=True)
class SummaryPlan:
    """Which pieces' summaries go from which rank to which, in one uneven all-to-all.

    ``sends[r][r2]``: local indices (into ``layout.pieces[r]``) of the pieces whose summaries
    rank ``r`` sends to rank ``r2`` — the pieces of ``r`` that precede, in their document, a
    piece of ``r2`` that does not start the document. ``doc_order[d]``: the pieces ``(r, i)``
    of document ``d`` in document order.
    """

    sends: tuple[tuple[tuple[int, ...], ...], ...]
    doc_order: dict[int, tuple[tuple[int, int], ...]]

    @property
    def total(self) -> int:
        return sum(len(x) for row in self.sends for x in row)

    def received(self, rank: int) -> int:
        return sum(len(row[rank]) for row in self.sends)

    def summary_bytes_per_rank(
        self, heads: int, dk: int, dv: int, bytes_per_elem: int = 4
    ) -> list[int]:
        """Per rank, bytes of summaries received ([H, K, K + V] per piece)."""
        return [
            self.received(r) * heads * dk * (dk + dv) * bytes_per_elem
            for r in range(len(self.sends))
        ]


@functools.lru_cache(maxsize=16)
def plan_summaries(layout: CPLayout) -> SummaryPlan:
    """The summary exchange of ``layout`` (the same on every rank)."""
    doc_order: dict[int, list[tuple[int, int, int]]] = {}
    for r, pcs in enumerate(layout.pieces):
        for i, p in enumerate(pcs):
            doc_order.setdefault(p.doc, []).append((p.start, r, i))
    cp = layout.cp_size
    sends: list[list[set[int]]] = [[set() for _ in range(cp)] for _ in range(cp)]
    for entries in doc_order.values():
        entries.sort()
        for j, (start, r2, _) in enumerate(entries):
            if start > 0:
                for _, r, i in entries[:j]:
                    if r != r2:
                        sends[r][r2].add(i)
    order = {d: tuple((r, i) for _, r, i in entries) for d, entries in doc_order.items()}
    return SummaryPlan(tuple(tuple(tuple(sorted(x)) for x in row) for row in sends), order)


def cp_gated_delta(q_THK, k_THK, v_THV, g_TH, beta_TH, layout, group, rank, state0_NHKV, runner):
    """This rank's outputs [T_local, H, V] and final states [N, H, K, V] (see module docstring)."""
    pieces = layout.pieces[rank]
    heads, dk, dv = v_THV.shape[1], k_THK.shape[2], v_THV.shape[2]
    starts = [0]
    for p in pieces:
        starts.append(starts[-1] + len(p))
    bounds = [(starts[i], starts[i + 1]) for i in range(len(pieces))]
    known = [i for i, p in enumerate(pieces) if p.start == 0]
    unknown = [i for i, p in enumerate(pieces) if p.start > 0]

    zero_state = v_THV.new_zeros(heads, dk, dv)
    init = [zero_state if state0_NHKV is None else state0_NHKV[pieces[i].doc] for i in known]
    s0_known = torch.stack(init) if init else v_THV.new_zeros(0, heads, dk, dv)
    out_known, final_known = runner(
        q_THK, k_THK, v_THV, g_TH, beta_TH, tuple(bounds[i] for i in known), s0_known
    )

    v_aug = torch.cat([v_THV.new_zeros(v_THV.shape[0], heads, dk), v_THV], dim=-1)
    eye = torch.eye(dk, dtype=v_THV.dtype, device=v_THV.device).expand(len(unknown), heads, dk, dk)
    s0_aug = torch.cat([eye, v_THV.new_zeros(len(unknown), heads, dk, dv)], dim=-1)
    out_aug, final_aug = runner(
        q_THK, k_THK, v_aug, g_TH, beta_TH, tuple(bounds[i] for i in unknown), s0_aug
    )

    # Local summaries: (A or None, B); A is None for pieces whose incoming state is known.
    summary: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    for n, i in enumerate(known):
        summary[(rank, i)] = (None, final_known[n])
    for n, i in enumerate(unknown):
        summary[(rank, i)] = (final_aug[n, ..., :dk], final_aug[n, ..., dk:])

    plan = plan_summaries(layout)
    touch = v_THV.new_zeros(())
    if plan.total > 0:
        zeros_KK = v_THV.new_zeros(heads, dk, dk)
        order = [i for dest in plan.sends[rank] for i in dest]
        rows = [
            torch.cat([_a_or(summary[(rank, i)][0], zeros_KK), summary[(rank, i)][1]], -1)
            for i in order
        ]
        # Every rank must run the all-to-all's backward (the reverse all-to-all), or the ranks
        # that do wait forever. So every rank's sent rows are on the autograd graph (also when
        # it sends nothing: empty slices of the inputs anchor them), and every rank's outputs
        # touch the received buffer (an empty slice: zero gradient, no NaN risk).
        anchors = [
            x[:0].sum() for x in (q_THK, k_THK, v_THV, g_TH, beta_TH, state0_NHKV) if x is not None
        ]
        send = torch.stack(rows) if rows else v_THV.new_zeros(0, heads, dk, dk + dv)
        send = (send + sum(anchors)).flatten(1).contiguous()
        recv_counts = [len(plan.sends[r][rank]) for r in range(layout.cp_size)]
        send_counts = [len(x) for x in plan.sends[rank]]
        received = fc.all_to_all_single_autograd(send, recv_counts, send_counts, group=group)
        received = received.unflatten(1, (heads, dk, dk + dv))
        touch = received[:0].sum()
        row = 0
        for r in range(layout.cp_size):
            for i in plan.sends[r][rank]:
                summary[(r, i)] = (received[row, ..., :dk], received[row, ..., dk:])
                row += 1

    s_in = _incoming_states(plan, layout, rank, unknown, summary)
    outs: dict[int, torch.Tensor] = {}
    finals: dict[int, torch.Tensor] = {}
    lengths = [len(pieces[i]) for i in unknown]
    for n, (i, chunk) in enumerate(zip(unknown, out_aug.split(lengths), strict=True)):
        qt_THK, o0_THV = chunk[..., :dk], chunk[..., dk:]
        outs[i] = o0_THV + torch.einsum("thk,hkv->thv", qt_THK, s_in[i])
        finals[i] = final_aug[n, ..., :dk] @ s_in[i] + final_aug[n, ..., dk:]
    for i, chunk in zip(known, out_known.split([len(pieces[i]) for i in known]), strict=True):
        outs[i] = chunk
    for n, i in enumerate(known):
        finals[i] = final_known[n]

    out = (
        torch.cat([outs[i] for i in range(len(pieces))])
        if pieces
        else v_THV.new_zeros(0, heads, dv)
    )
    doc_len = [b - a for a, b in zip(layout.cu_seqlens[:-1], layout.cu_seqlens[1:], strict=True)]
    last = {p.doc: i for i, p in enumerate(pieces) if p.end == doc_len[p.doc]}
    final = torch.stack(
        [finals[last[d]] if d in last else zero_state for d in range(layout.num_docs)]
    )
    return out + touch, final + touch


def _a_or(a_KK: torch.Tensor | None, zeros_KK: torch.Tensor) -> torch.Tensor:
    return zeros_KK if a_KK is None else a_KK


def _incoming_states(plan, layout, rank, unknown, summary):
    """S_in of each local piece that does not start its document: scan its document's pieces."""
    need: dict[int, list[int]] = {}
    for i in unknown:
        need.setdefault(layout.pieces[rank][i].doc, []).append(i)
    s_in: dict[int, torch.Tensor] = {}
    for doc, wanted in need.items():
        remaining, state = set(wanted), None
        for key in plan.doc_order[doc]:
            if key[0] == rank and key[1] in remaining:
                s_in[key[1]] = state
                remaining.discard(key[1])
                if not remaining:
                    break
            a_KK, b_KV = summary[key]
            state = b_KV if a_KK is None or state is None else a_KK @ state + b_KV
    return s_in
