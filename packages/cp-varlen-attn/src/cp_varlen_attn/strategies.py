"""Layout strategies: contiguous, per-document zigzag, and balanced.

Cost model (see ``CPLayout``): a token at offset ``i`` of its document costs
``a * (i + 1) + b``; the prefix cost of a document's first ``n`` tokens is
``P(n) = a * n * (n + 1) / 2 + b * n`` and a piece ``[s, e)`` costs ``P(e) - P(s)``.

``balanced`` keeps short documents whole and splits only what must be split:

1. Budgets: every rank gets ``total_cost / cp`` of cost and ``S / cp`` of tokens.
2. A document bigger than one rank's budget (in cost or tokens) is spread over just enough
   ranks (those with the most room) that it fills at most ``SPLIT_FILL`` of their budgets.
3. The other documents, most expensive first, go whole to the rank whose remaining
   (cost, tokens) budget best matches their demand, among the ranks that can take them.
4. A document that fits nowhere whole is cut over the fewest ranks that cover it.

Every cut is a set of head/tail pairs: rank j takes ``[h, h + x)`` and ``[t - y, t)`` and the
last rank the middle. For a fixed count ``x + y`` the pair's cost decreases in ``x``, so the
count (the rank's share of the token budget, moved only as far as the cost budget requires)
and the split ``x`` (its share of the cost budget) are found by bisection. Pairing a cheap head
with an expensive tail is what keeps token counts even while costs are equal. Exactness never
depends on any of this: a layout is only a permutation of tokens into pieces.

Ranks receive K/V only for the split documents, and only their earlier parts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from cp_varlen_attn.layout import CPLayout, Piece

__all__ = ["STRATEGIES", "plan_cp_layout"]

STRATEGIES = ("contiguous", "zigzag", "balanced")

# Per-token linear work (projections, MoE, GDN) in units of "one query-key pair of causal
# attention". Qwen3.5-35B-A3B does ~2·3e9 FLOPs per token in its matmuls and 4·16·256 FLOPs per
# query-key pair in each of its 10 full-attention layers: a ratio of ~37K; attention kernels run
# at roughly half the matmul FLOP rate, hence ~16K. Pass token_weight=0 for attention-only cost.
DEFAULT_TOKEN_WEIGHT = 16384.0

# A document too big for one rank is spread so that it fills at most this fraction of each
# chosen rank's budgets: the rest is left for cheaper documents, which is what lets cost AND
# token counts balance, while keeping the number of ranks that need its K/V small.
SPLIT_FILL = 0.5


def plan_cp_layout(
    cu_seqlens: torch.Tensor | Sequence[int],
    cp_size: int,
    *,
    strategy: str = "balanced",
    attn_weight: float = 1.0,
    token_weight: float = DEFAULT_TOKEN_WEIGHT,
) -> CPLayout:
    """Split the packed sequence described by ``cu_seqlens`` (int [n_docs + 1]) over ``cp_size`` ranks.

    Cost of a token at offset ``i`` of its document: ``attn_weight * (i + 1) + token_weight``.
    Deterministic: every rank computing it from the same ``cu_seqlens`` gets the same layout.
    """
    cu = _as_boundaries(cu_seqlens)
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if attn_weight < 0 or token_weight < 0 or attn_weight + token_weight == 0:
        raise ValueError(
            f"cost weights must be >= 0 and not both 0, got attn {attn_weight}, token {token_weight}"
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    lengths = [b - a for a, b in itertools.pairwise(cu)]
    padding = 0
    if strategy == "contiguous":
        per_rank = _contiguous(cu, cp_size)
    elif strategy == "zigzag":
        per_rank = _zigzag(lengths, cp_size)
        padding = sum(-n % (2 * cp_size) for n in lengths)
    else:
        per_rank = _Balancer(lengths, cp_size, attn_weight, token_weight).run()
    ordered = tuple(tuple(sorted(pcs, key=lambda p: cu[p.doc] + p.start)) for pcs in per_rank)
    return CPLayout(tuple(cu), ordered, strategy, attn_weight, token_weight, padding)


def _as_boundaries(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(
                f"cu_seqlens: expected a 1-D tensor, got shape {tuple(cu_seqlens.shape)}"
            )
        cu = [int(x) for x in cu_seqlens.tolist()]
    else:
        cu = [int(x) for x in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(
            f"cu_seqlens must start at 0 and hold at least one document, got {cu[:16]}"
        )
    bad = [i for i in range(1, len(cu)) if cu[i] <= cu[i - 1]]
    if bad:
        raise ValueError(
            f"cu_seqlens must increase strictly; entry {bad[0]} ({cu[bad[0]]}) follows {cu[bad[0] - 1]}"
        )
    return cu


def _contiguous(cu: list[int], cp: int) -> list[list[Piece]]:
    seq = cu[-1]
    cuts = [seq * r // cp for r in range(cp + 1)]
    out: list[list[Piece]] = [[] for _ in range(cp)]
    for r in range(cp):
        lo, hi = cuts[r], cuts[r + 1]
        for d in range(len(cu) - 1):
            s, e = max(lo, cu[d]), min(hi, cu[d + 1])
            if s < e:
                out[r].append(Piece(d, s - cu[d], e - cu[d]))
    return out


def _zigzag(lengths: list[int], cp: int) -> list[list[Piece]]:
    """Per document: 2·cp near-equal chunks, rank r takes chunks r and 2·cp-1-r (no padding
    is inserted; the padding Megatron would need is reported by the layout)."""
    out: list[list[Piece]] = [[] for _ in range(cp)]
    n_chunks = 2 * cp
    for d, n in enumerate(lengths):
        bounds = [n * j // n_chunks for j in range(n_chunks + 1)]
        for r in range(cp):
            for j in (r, n_chunks - 1 - r):
                if bounds[j] < bounds[j + 1]:
                    out[r].append(Piece(d, bounds[j], bounds[j + 1]))
    return out


class _Balancer:
    """The ``balanced`` planner (module docstring): per-rank budgets and the pieces given so far."""

    def __init__(self, lengths: list[int], cp: int, a: float, b: float) -> None:
        self.lengths, self.cp, self.a, self.b = lengths, cp, a, b
        self.cost_per_rank = sum(self.prefix(n) for n in lengths) / cp
        self.tokens_per_rank = sum(lengths) / cp
        self.cost_left = [self.cost_per_rank] * cp
        self.tokens_left = [self.tokens_per_rank] * cp
        self.out: list[list[Piece]] = [[] for _ in range(cp)]
        self.eps = 1e-9 * max(self.cost_per_rank, 1.0)

    def prefix(self, n: int) -> float:
        return self.a * n * (n + 1) / 2 + self.b * n

    def room(self, r: int) -> float:
        return self.cost_left[r] / self.cost_per_rank + self.tokens_left[r] / self.tokens_per_rank

    def run(self) -> list[list[Piece]]:
        order = sorted(range(len(self.lengths)), key=lambda d: (-self.lengths[d], d))
        whole, leftover = [], []
        for d in order:
            demand = max(
                self.prefix(self.lengths[d]) / self.cost_per_rank,
                self.lengths[d] / self.tokens_per_rank,
            )
            if demand > 1.0:
                k = min(self.cp, math.ceil(demand / SPLIT_FILL))
                self.split(d, sorted(range(self.cp), key=lambda r: (-self.room(r), r))[:k])
            else:
                whole.append(d)
        for d in whole:
            rank = self.best_fit(d)
            if rank is None:
                leftover.append(d)
            else:
                self.give(rank, d, 0, self.lengths[d])
        for d in leftover:
            self.split(d, self.ranks_covering(d))
        return self.out

    def best_fit(self, doc: int) -> int | None:
        """Among ranks that can take the document whole within both budgets, the one whose
        remaining (cost, tokens) best matches its demand (largest normalised dot product)."""
        n, cost = self.lengths[doc], self.prefix(self.lengths[doc])
        fits = [
            r
            for r in range(self.cp)
            if cost <= self.cost_left[r] + self.eps and n <= self.tokens_left[r] + 0.5
        ]
        return max(
            fits,
            key=lambda r: (
                cost * self.cost_left[r] / self.cost_per_rank
                + n * self.tokens_left[r] / self.tokens_per_rank,
                -r,
            ),
            default=None,
        )

    def ranks_covering(self, doc: int) -> list[int]:
        """The fewest ranks (most budget left first) whose cost and token budgets cover the document."""
        n, cost = self.lengths[doc], self.prefix(self.lengths[doc])
        chosen, cost_cover, token_cover = [], 0.0, 0.0
        for r in sorted(range(self.cp), key=lambda r: (-self.room(r), r)):
            chosen.append(r)
            cost_cover += max(self.cost_left[r], 0.0)
            token_cover += max(self.tokens_left[r], 0.0)
            if cost_cover >= cost - self.eps and token_cover >= n - 0.5:
                break
        return chosen

    def give(self, rank: int, doc: int, s: int, e: int) -> None:
        if s < e:
            self.out[rank].append(Piece(doc, s, e))
            self.cost_left[rank] -= self.prefix(e) - self.prefix(s)
            self.tokens_left[rank] -= e - s

    def split(self, doc: int, chosen: list[int]) -> None:
        """Head/tail pairs over ``chosen``, outside in: rank j's token count ∝ its token budget and
        its cost ∝ its cost budget (cost wins where both cannot hold); the last takes the middle."""
        n, cost = self.lengths[doc], self.prefix(self.lengths[doc])
        token_room = sum(max(self.tokens_left[r], 0.0) for r in chosen)
        cost_room = sum(max(self.cost_left[r], 0.0) for r in chosen)
        h, t = 0, n
        for r in chosen[:-1]:
            t_share = (
                max(self.tokens_left[r], 0.0) / token_room if token_room > 0 else 1 / len(chosen)
            )
            c_share = max(self.cost_left[r], 0.0) / cost_room if cost_room > 0 else 1 / len(chosen)
            budget = cost * c_share
            count = self.feasible_count(h, t, round(n * t_share), budget)
            x = self.solve_head(h, t, count, budget)
            self.give(r, doc, h, h + x)
            self.give(r, doc, t - (count - x), t)
            h, t = h + x, t - (count - x)
        self.give(chosen[-1], doc, h, t)

    def feasible_count(self, h: int, t: int, target: int, budget: float) -> int:
        """The token count nearest ``target`` for which some head/tail pair over [h, t) costs
        ``budget``: at least enough all-tail tokens to reach it, at most as many all-head
        tokens as stay within it. Cost is the tighter target, so tokens give way."""
        avail = t - h
        lo = _first_true(0, avail, lambda c: self.prefix(t) - self.prefix(t - c) >= budget)
        hi = _first_true(0, avail, lambda c: self.prefix(h + c) - self.prefix(h) > budget) - 1
        return min(max(target, lo), max(hi, lo), avail)

    def solve_head(self, h: int, t: int, count: int, budget: float) -> int:
        """x in [0, count] with pair cost P(h+x)-P(h) + P(t)-P(t-count+x) closest to budget."""

        def pair(x: int) -> float:
            return self.prefix(h + x) - self.prefix(h) + self.prefix(t) - self.prefix(t - count + x)

        x = min(_first_true(0, count, lambda x: pair(x) <= budget), count)
        if x > 0 and abs(pair(x - 1) - budget) < abs(pair(x) - budget):
            return x - 1
        return x


def _first_true(lo: int, hi: int, pred) -> int:
    """Smallest c in [lo, hi] with pred(c) true (pred monotone false→true); hi + 1 if none."""
    hi_excl = hi + 1
    while lo < hi_excl:
        mid = (lo + hi_excl) // 2
        if pred(mid):
            hi_excl = mid
        else:
            lo = mid + 1
    return lo
