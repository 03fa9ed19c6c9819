"""The ``balanced`` CP layout: every rank gets its share of causal attention pairs AND of tokens.

Why both, separately: the ranks of a CP group meet at every layer (K/V exchange, GDN state
exchange, MoE all-to-all), so a step lasts ``Σ_layers max_r work(layer, r)``. Attention layers
cost ∝ the rank's causal query-key pairs, every other layer ∝ its tokens; balancing a weighted
sum of the two leaves one of them lopsided, and the slowest rank of each layer sets the pace.
When pairs AND tokens are both at their means on every rank, every weighted sum is too.

Cost facts: the token at offset ``i`` of its document is the query of ``i + 1`` causal pairs, so
the first ``n`` tokens of a document hold ``P(n) = n(n+1)/2`` pairs and a piece ``[s, e)`` holds
``P(e) − P(s)``: ``e − s`` tokens at a density (pairs per token) of ``(s + e + 1) / 2``. Every
rank must end at the global density ``D = total pairs / total tokens``.

Two streams of documents, each consumed in order and each document outside in — a rank takes
whole documents and at most one head/tail pair ``[h, h + x) ∪ [t − y, t)`` of a stream's current
document, whose remaining interval ``[h, t)`` shrinks towards its middle:

- sparse: documents whose whole density ``(L + 1)/2`` is below ``D``. A cut one is cut
  symmetrically (``x = y``), which keeps both the pair and the remaining middle at the whole
  document's density, so every sparse share has density below ``D``: a rank can always dilute.
- dense: the others. For ``n = x + y`` tokens the pair's density ranges over
  ``[h + (n+1)/2, t − (n−1)/2]`` (all head … all tail) and falls as ``x`` grows: this is the
  knob that meets a pair target exactly.

Ranks are filled one after another. Rank ``r`` gets exactly its token share ``T_r`` and aims at
the cumulative pair target ``(r + 1)/cp · total pairs`` (so a rounding miss of one rank is
absorbed by the next): it takes ``a`` tokens from the sparse stream and ``T_r − a`` from the
dense one. ``a`` is taken at a sparse document boundary near the point where a symmetric dense
split would meet the target, then ``x`` of the last dense document the rank touches closes the
pair target (bisection). Before each rank the unopened dense documents are reordered so that
the next one needs the share of sparse tokens that lets both streams run out together (a
densest-first order would spend the sparse stream early and leave the last ranks undilutable).
The last rank takes what remains — by conservation exactly its share when every earlier rank
met its target. Where no choice meets a target (tiny packs: fewer tokens than ranks, one-token
documents) the nearest one is taken and the layout reports the miss
(:attr:`CPLayout.balance_misses`).

Communication: a rank boundary cuts at most one dense document and, only when no sparse
boundary fits, one sparse document, so at most ``2(cp − 1)`` documents are split and K/V moves
only for them; a rank holds at most two pieces of a document. Exactness never depends on any of this: a layout is a permutation of tokens.
"""

from __future__ import annotations

import bisect

from cp_varlen_attn.layout import Piece

__all__ = ["plan_balanced"]

# Sparse document boundaries tried on each side of the symmetric split point, per rank.
BOUNDARY_CANDIDATES = 8
# A rank's pairs may miss its cumulative target by this fraction of the per-rank mean before a
# cut inside a sparse document is preferred to a whole-document boundary.
PAIR_TOLERANCE = 0.002


def _pairs(n: int) -> int:
    """Causal pairs of a document's first ``n`` tokens."""
    return n * (n + 1) // 2


def _cumulative(docs: list[int], lengths: list[int]) -> tuple[list[int], list[int]]:
    tokens, pairs = [0], [0]
    for d in docs:
        tokens.append(tokens[-1] + lengths[d])
        pairs.append(pairs[-1] + _pairs(lengths[d]))
    return tokens, pairs


class _Stream:
    """Documents consumed in order, each outside in: ``docs[i]`` has ``[h, t)`` left, later ones
    are whole. A rank takes whole documents and at most one head/tail pair (``x`` from the head)."""

    def __init__(self, docs: list[int], lengths: list[int]) -> None:
        self.docs, self.lengths = docs, lengths
        self.cum_tokens, self.cum_pairs = _cumulative(docs, lengths)
        self.i, self.h = 0, 0
        self.t = lengths[docs[0]] if docs else 0

    @property
    def remaining(self) -> int:
        if self.i >= len(self.docs):
            return 0
        return self.t - self.h + self.cum_tokens[-1] - self.cum_tokens[self.i + 1]

    @property
    def remaining_pairs(self) -> int:
        if self.i >= len(self.docs):
            return 0
        rest = self.cum_pairs[-1] - self.cum_pairs[self.i + 1]
        return _pairs(self.t) - _pairs(self.h) + rest

    def boundaries(self, lo: int, hi: int) -> list[int]:
        """Token counts in ``[lo, hi]`` after which the stream sits at a document boundary."""
        if self.i >= len(self.docs):
            return [0] if lo <= 0 <= hi else []
        base = self.t - self.h - self.cum_tokens[self.i + 1]
        ends = [0, *(c + base for c in self.cum_tokens[self.i + 1 :])]
        return ends[bisect.bisect_left(ends, lo) : bisect.bisect_right(ends, hi)]

    def symmetric(self, b: int) -> int:
        """The head count that keeps the remaining interval centred."""
        return self.last_pair_len(b) // 2

    def reorder(self, key) -> None:
        """Sort the documents not yet opened by ``key`` (the current one stays current)."""
        self.docs = self.docs[: self.i + 1] + sorted(self.docs[self.i + 1 :], key=key)
        self.cum_tokens, self.cum_pairs = _cumulative(self.docs, self.lengths)

    def _split(self, b: int) -> tuple[int, int, int]:
        """For ``b`` tokens: (pairs of what is taken whole, index of the last doc touched, tokens
        taken from that doc as a head/tail pair — ``x`` of them from its head)."""
        m = self.t - self.h
        if b <= m:
            return 0, self.i, b
        whole = _pairs(self.t) - _pairs(self.h)
        end = self.cum_tokens[self.i + 1] + b - m
        j = bisect.bisect_right(self.cum_tokens, end) - 1
        whole += self.cum_pairs[j] - self.cum_pairs[self.i + 1]
        return whole, j, end - self.cum_tokens[j]

    def _interval(self, j: int) -> tuple[int, int]:
        return (self.h, self.t) if j == self.i else (0, self.lengths[self.docs[j]])

    def last_pair_len(self, b: int) -> int:
        return self._split(b)[2]

    def pairs(self, b: int, x: int) -> int:
        """Pairs of the next ``b`` tokens, ``x`` of the last pair's tokens from its head."""
        whole, j, n = self._split(b)
        if n == 0:
            return whole
        h, t = self._interval(j)
        return whole + _pairs(h + x) - _pairs(h) + _pairs(t) - _pairs(t - (n - x))

    def take(self, b: int, x: int) -> list[Piece]:
        _, j, n = self._split(b)
        out: list[Piece] = []
        while self.i < j:
            out.append(Piece(self.docs[self.i], self.h, self.t))
            self._next_doc()
        if n > 0:
            doc = self.docs[j]
            out += [Piece(doc, self.h, self.h + x), Piece(doc, self.t - (n - x), self.t)]
            self.h, self.t = self.h + x, self.t - (n - x)
            if self.h == self.t:
                self._next_doc()
        return [p for p in out if len(p) > 0]

    def _next_doc(self) -> None:
        self.i += 1
        self.h = 0
        self.t = self.lengths[self.docs[self.i]] if self.i < len(self.docs) else 0


def plan_balanced(lengths: list[int], cp: int) -> list[list[Piece]]:
    """Per rank, its pieces (module docstring); deterministic in ``lengths`` and ``cp``."""
    if cp == 1:
        return [[Piece(d, 0, n) for d, n in enumerate(lengths)]]
    total_tokens = sum(lengths)
    total_pairs = sum(_pairs(n) for n in lengths)
    density = total_pairs / total_tokens
    by_length = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))
    # (L + 1) / 2 is a whole document's density: below D it is sparse.
    sparse = _Stream(_interleave([d for d in by_length if lengths[d] + 1 < 2 * density]), lengths)
    dense = _Stream([d for d in by_length if lengths[d] + 1 >= 2 * density], lengths)
    out: list[list[Piece]] = []
    given_tokens = given_pairs = 0
    tolerance = PAIR_TOLERANCE * total_pairs / cp
    for r in range(cp - 1):
        tokens = (r + 1) * total_tokens // cp - given_tokens
        target = round((r + 1) * total_pairs / cp) - given_pairs
        dense.reorder(
            _dense_order(sparse, lengths, total_tokens - given_tokens, total_pairs - given_pairs)
        )
        a, x = _choose(tokens, target, sparse, dense, tolerance)
        pieces = sparse.take(a, sparse.symmetric(a)) + dense.take(tokens - a, x)
        given_tokens += tokens
        given_pairs += sum(_pairs(p.end) - _pairs(p.start) for p in pieces)
        out.append(pieces)
    out.append(sparse.take(sparse.remaining, 0) + dense.take(dense.remaining, 0))
    return [_merge(pcs) for pcs in out]


def _interleave(docs: list[int]) -> list[int]:
    """Longest, shortest, second longest, … : a stream whose density is even along its length."""
    out = []
    for i in range((len(docs) + 1) // 2):
        out.append(docs[i])
        if len(docs) - 1 - i > i:
            out.append(docs[len(docs) - 1 - i])
    return out


def _dense_order(sparse: _Stream, lengths: list[int], tokens_left: int, pairs_left: int):
    """Sort key for the dense documents still unopened: first the one whose symmetric share
    needs the fraction of sparse tokens per rank that keeps both streams ending together."""
    need = pairs_left / tokens_left if tokens_left else 0.0
    have = sparse.remaining / tokens_left if tokens_left else 0.0
    sparse_density = sparse.remaining_pairs / sparse.remaining if sparse.remaining else 0.0

    def key(d: int) -> tuple[float, int, int]:
        own = lengths[d] / 2
        fraction = (own - need) / (own - sparse_density) if own > sparse_density else 0.0
        return abs(fraction - have), -lengths[d], d

    return key


def _choose(
    tokens: int, target: int, sparse: _Stream, dense: _Stream, tolerance: float
) -> tuple[int, int]:
    """(sparse tokens ``a``, head count ``x`` of the last dense pair) for one rank."""
    lo, hi = max(0, tokens - dense.remaining), min(tokens, sparse.remaining)

    def symmetric_excess(a: int) -> int:
        b = tokens - a
        return sparse.pairs(a, sparse.symmetric(a)) + dense.pairs(b, dense.symmetric(b)) - target

    pivot = _crossing(lo, hi, symmetric_excess)
    below = sparse.boundaries(lo, pivot)[-BOUNDARY_CANDIDATES:]
    above = sparse.boundaries(pivot, hi)[:BOUNDARY_CANDIDATES]
    candidates = sorted(set(below + above), key=lambda a: (abs(a - pivot), a))
    best: tuple[int, int, int] | None = None
    for a in [*candidates, pivot]:
        x, miss = _close(tokens - a, target - sparse.pairs(a, sparse.symmetric(a)), dense)
        if miss <= tolerance:
            return a, x
        if best is None or miss < best[0]:
            best = (miss, a, x)
    assert best is not None
    return best[1], best[2]


def _crossing(lo: int, hi: int, excess) -> int:
    """An ``a`` in ``[lo, hi]`` where ``excess`` changes sign (bisection), else the endpoint
    with the smaller ``|excess|``."""
    e_lo, e_hi = excess(lo), excess(hi)
    if e_lo == 0 or (e_lo > 0) == (e_hi > 0):
        return lo if abs(e_lo) <= abs(e_hi) else hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (excess(mid) > 0) == (e_lo > 0):
            lo = mid
        else:
            hi = mid
    return lo if abs(excess(lo)) <= abs(excess(hi)) else hi


def _close(b: int, want: int, dense: _Stream) -> tuple[int, int]:
    """Head count ``x`` whose dense pairs for ``b`` tokens come closest to ``want`` (pairs fall
    as ``x`` grows), and the remaining miss."""
    n = dense.last_pair_len(b)
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if dense.pairs(b, mid) >= want:
            lo = mid
        else:
            hi = mid
    x = min((lo, hi), key=lambda x: abs(dense.pairs(b, x) - want))
    return x, abs(dense.pairs(b, x) - want)


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Pieces sorted by (doc, start) with touching pieces of one document joined."""
    out: list[Piece] = []
    for p in sorted(pieces):
        if out and out[-1].doc == p.doc and out[-1].end == p.start:
            out[-1] = Piece(p.doc, out[-1].start, p.end)
        else:
            out.append(p)
    return out
