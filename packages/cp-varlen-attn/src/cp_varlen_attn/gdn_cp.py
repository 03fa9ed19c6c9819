"""The gated delta rule under CP: affine piece summaries composed by a parallel prefix.

Per value head the state after a run of tokens is affine in the state before it:
``S_out = 𝒜·S_in + ℬ`` and every output is ``o_t = o_t⁰ + q̃_tᵀ·S_in`` with ``q̃_t = 𝒜_{≤t}ᵀ q_t``
(ALGORITHMS.md). A piece that does not start its document is therefore run ONCE from the
augmented state ``[I | 0]`` ∈ R^{K×(K+V)} with augmented values ``[0 | v]``: the first K
columns of its state evolve as ``𝒜_{≤t}`` and the last V as the zero-start state, so its final
state is ``[𝒜 | ℬ]`` and its outputs are ``[q̃_t | o_t⁰]`` — everything the correction needs.
A piece that starts its document knows its incoming state (the document's initial state, or
zero) and is run directly; its summary is the constant map ``(𝒜 = 0, ℬ = S_out)``.

Summaries compose as a monoid, ``(𝒜₂, ℬ₂)∘(𝒜₁, ℬ₁) = (𝒜₂𝒜₁, 𝒜₂ℬ₁ + ℬ₂)``, so the state entering
a piece is a prefix product over the earlier pieces of its document. The pieces of a document
form runs (consecutive pieces on one rank, composed locally), ``x_0, …, x_{m−1}`` in document
order; run ``j`` needs ``y_{j−1} = x_{j−1}∘…∘x_0``. An exclusive Hillis–Steele scan delivers
it: round 0 hands each run the summary of the run before it (``w_j = x_{j−1}``), round
``k ≥ 1`` hands run ``j`` the running value of run ``j − 2^(k−1)`` (``w_j ← w_j ∘ w_{j−2^(k−1)}``,
both taken at the start of the round). After ``1 + ⌈log2(m − 1)⌉`` rounds ``w_j`` covers runs
``[0, j − 1]``; since ``x_0`` is constant, so is ``w_j``: it is the state itself. A run therefore
receives at most ``1 + ⌈log2(m − 1)⌉`` summaries, ``[H, K, K+V]`` each and independent of the
piece lengths — instead of one per earlier piece.

Each round is one uneven ``all_to_all_single_autograd`` over the group (messages between runs
on one rank stay local; rounds with no cross-rank message are skipped — the plan, identical on
every rank, decides). Its backward is the reverse all-to-all, so the gradient of a summary
from every run that used it is summed on the summary's owner: autograd gives the exact
backward, the mirrored suffix scan. Every rank's round ``k + 1`` sends also depend on its round
``k`` receive (an empty slice), so every rank runs the backward rounds in the same order.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.distributed import _functional_collectives as fc

from cp_varlen_attn.layout import CPLayout

__all__ = ["SummaryPlan", "cp_gated_delta", "plan_summaries"]


@dataclasses.dataclass(frozen=True)
class Message:
    """Round message: the value of run ``src_run`` (on ``src``) to run ``dst_run`` (on ``dst``)
    of document ``doc``; ``constant``: that value already covers the document's first run."""

    src: int
    dst: int
    doc: int
    src_run: int
    dst_run: int
    constant: bool


@dataclasses.dataclass(frozen=True)
class SummaryPlan:
    """The parallel-prefix exchange of a layout (module docstring).

    ``runs[d]``: document ``d``'s runs in order, each ``(rank, local piece indices)``.
    ``rounds[k]``: round ``k``'s messages, sorted by (src, dst, doc, dst_run) — the order in
    which every sender packs and every receiver unpacks them.
    """

    cp_size: int
    runs: dict[int, tuple[tuple[int, tuple[int, ...]], ...]]
    rounds: tuple[tuple[Message, ...], ...]

    @property
    def total(self) -> int:
        """Summaries that cross ranks, over all rounds."""
        return sum(m.src != m.dst for msgs in self.rounds for m in msgs)

    @property
    def collectives(self) -> int:
        """All-to-all calls per GDN layer (rounds with a cross-rank message)."""
        return sum(any(m.src != m.dst for m in msgs) for msgs in self.rounds)

    def received(self, rank: int) -> int:
        """Summaries ``rank`` receives from other ranks, over all rounds."""
        return sum(m.dst == rank != m.src for msgs in self.rounds for m in msgs)

    def summary_bytes_per_rank(
        self, heads: int, dk: int, dv: int, bytes_per_elem: int = 4
    ) -> list[int]:
        """Per rank, bytes of summaries received ([H, K, K + V] each)."""
        size = heads * dk * (dk + dv) * bytes_per_elem
        return [self.received(r) * size for r in range(self.cp_size)]


@functools.lru_cache(maxsize=16)
def plan_summaries(layout: CPLayout) -> SummaryPlan:
    """The summary exchange of ``layout`` (the same on every rank)."""
    entries: dict[int, list[tuple[int, int, int]]] = {}
    for r, pcs in enumerate(layout.pieces):
        for i, p in enumerate(pcs):
            entries.setdefault(p.doc, []).append((p.start, r, i))
    runs: dict[int, tuple[tuple[int, tuple[int, ...]], ...]] = {}
    for doc, found in entries.items():
        grouped: list[tuple[int, list[int]]] = []
        for _, r, i in sorted(found):
            if grouped and grouped[-1][0] == r:
                grouped[-1][1].append(i)
            else:
                grouped.append((r, [i]))
        runs[doc] = tuple((r, tuple(ix)) for r, ix in grouped)
    rounds: list[list[Message]] = [[]]
    low: dict[tuple[int, int], int] = {}  # (doc, run) → first run its value covers
    for doc, rs in runs.items():
        for j in range(1, len(rs)):
            rounds[0].append(Message(rs[j - 1][0], rs[j][0], doc, j - 1, j, j - 1 == 0))
            low[(doc, j)] = j - 1
    stride = 1
    while any(len(rs) - 1 > stride for rs in runs.values()):
        msgs = []
        for doc, rs in runs.items():
            for j in range(stride + 1, len(rs)):
                src_low = low[(doc, j - stride)]
                msgs.append(Message(rs[j - stride][0], rs[j][0], doc, j - stride, j, src_low == 0))
        low.update({(m.doc, m.dst_run): low[(m.doc, m.src_run)] for m in msgs})
        rounds.append(msgs)
        stride *= 2
    order = lambda m: (m.src, m.dst, m.doc, m.dst_run)  # noqa: E731
    return SummaryPlan(
        layout.cp_size, runs, tuple(tuple(sorted(msgs, key=order)) for msgs in rounds)
    )


def _compose(later, earlier):
    """``later ∘ earlier`` of two summaries (A [H, K, K] or None for a constant, B [H, K, V])."""
    a2, b2 = later
    a1, b1 = earlier
    b = a2 @ b1 + b2
    return (None, b) if a1 is None else (a2 @ a1, b)


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

    # Each local piece's summary (A or None, B).
    summary: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    for n, i in enumerate(known):
        summary[i] = (None, final_known[n])
    for n, i in enumerate(unknown):
        summary[i] = (final_aug[n, ..., :dk], final_aug[n, ..., dk:])

    plan = plan_summaries(layout)
    inputs = (q_THK, k_THK, v_THV, g_TH, beta_TH, state0_NHKV)
    entering = _prefix_scan(plan, rank, summary, inputs, group)
    touch = entering.pop("touch")

    s_in: dict[int, torch.Tensor] = {}
    for doc, runs in plan.runs.items():
        for j, (r, run) in enumerate(runs):
            if r != rank:
                continue
            state = entering.get((doc, j))
            for i in run:
                if state is not None:
                    s_in[i] = state
                a_KK, b_KV = summary[i]
                state = b_KV if a_KK is None else a_KK @ state + b_KV

    outs: dict[int, torch.Tensor] = {}
    finals: dict[int, torch.Tensor] = {}
    lengths = [len(pieces[i]) for i in unknown]
    for n, (i, chunk) in enumerate(zip(unknown, out_aug.split(lengths), strict=True)):
        qt_THK, o0_THV = chunk[..., :dk], chunk[..., dk:]
        outs[i] = o0_THV + torch.einsum("thk,hkv->thv", qt_THK, s_in[i])
        finals[i] = final_aug[n, ..., :dk] @ s_in[i] + final_aug[n, ..., dk:]
    for n, (i, chunk) in enumerate(
        zip(known, out_known.split([len(pieces[i]) for i in known]), strict=True)
    ):
        outs[i] = chunk
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


def _prefix_scan(plan: SummaryPlan, rank: int, summary, inputs, group) -> dict:
    """The state entering each local run ``(doc, j)`` with ``j ≥ 1`` (the exclusive scan of the
    module docstring), plus ``"touch"``: a zero scalar on the last round's receive buffer, for
    the caller's outputs (so every rank runs every backward round)."""
    ref = inputs[2]
    heads, dk, dv = ref.shape[1], inputs[0].shape[2], ref.shape[2]
    runs_value: dict[tuple[int, int], tuple] = {}
    for doc, runs in plan.runs.items():
        for j, (r, run) in enumerate(runs):
            if r == rank:
                value = summary[run[0]]
                for i in run[1:]:
                    value = _compose(summary[i], value)
                runs_value[(doc, j)] = value
    # Every rank's first send is on the graph even when empty, and every later send hangs on
    # the previous receive: see the module docstring.
    anchor = sum(x[:0].sum() for x in inputs if x is not None)
    zeros_KK = ref.new_zeros(heads, dk, dk)
    w: dict[tuple[int, int], tuple] = {}
    for k, msgs in enumerate(plan.rounds):
        source = runs_value if k == 0 else dict(w)
        cross = [m for m in msgs if m.src != m.dst]
        arrived: dict[tuple[int, int], tuple] = {}
        if cross:
            outgoing = [m for m in cross if m.src == rank]
            values = [source[(m.doc, m.src_run)] for m in outgoing]
            rows = [torch.cat([_a_or(a_KK, zeros_KK), b_KV], -1) for a_KK, b_KV in values]
            send = torch.stack(rows) if rows else ref.new_zeros(0, heads, dk, dk + dv)
            send = (send + anchor).flatten(1).contiguous()
            send_counts = [sum(m.dst == r for m in outgoing) for r in range(plan.cp_size)]
            incoming = [m for m in cross if m.dst == rank]
            recv_counts = [sum(m.src == r for m in incoming) for r in range(plan.cp_size)]
            received = fc.all_to_all_single_autograd(send, recv_counts, send_counts, group=group)
            received = received.unflatten(1, (heads, dk, dk + dv))
            anchor = received[:0].sum()
            for n, m in enumerate(incoming):
                a_KK = None if m.constant else received[n, ..., :dk]
                arrived[(m.doc, m.dst_run)] = (a_KK, received[n, ..., dk:])
        for m in msgs:
            if m.dst != rank:
                continue
            value = arrived[(m.doc, m.dst_run)] if m.src != m.dst else source[(m.doc, m.src_run)]
            key = (m.doc, m.dst_run)
            w[key] = value if k == 0 else _compose(w[key], value)
    # After the last round every value covers its document's first run: a constant (the state).
    entering: dict = {key: b_KV for key, (_, b_KV) in w.items()}
    entering["touch"] = anchor
    return entering


def _a_or(a_KK: torch.Tensor | None, zeros_KK: torch.Tensor) -> torch.Tensor:
    return zeros_KK if a_KK is None else a_KK
