"""``CPLayout``: which pieces of which documents each context-parallel rank holds.

A layout is a permutation of the packed sequence's tokens into per-rank pieces. A piece is a
contiguous run ``[start, end)`` of ONE document (offsets inside the document); a rank's local
tokens are its pieces concatenated in global order. Exactness of attention and of the gated
delta rule never depends on the layout: they only need, per piece, its document, its offsets
and where the document's earlier tokens live — all of which the layout states. The strategies
(``strategies.py``) differ only in balance and communication, which the layout reports.

Every segment of ``cu_seqlens`` is a document here, padding runs included: a padding run then
attends only to itself, which keeps real documents exact wherever padding sits.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

__all__ = ["PAIR_BOUND", "TOKEN_BOUND", "CPLayout", "Piece", "shard_sequence", "unshard_sequence"]

# What ``balanced`` guarantees on packs that allow it (``CPLayout.balance_misses``).
PAIR_BOUND = 1.02
TOKEN_BOUND = 1.05


@dataclasses.dataclass(frozen=True, order=True)
class Piece:
    """Tokens ``[start, end)`` of document ``doc`` (offsets inside the document)."""

    doc: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class CPLayout:
    """Per rank, the pieces it holds, in global token order.

    ``attn_weight`` and ``token_weight`` are the cost model the layout is measured with: a token
    at offset ``i`` of its document costs ``attn_weight * (i + 1) + token_weight`` (causal
    attention over ``i + 1`` keys plus the per-token linear work).
    """

    cu_seqlens: tuple[int, ...]
    pieces: tuple[tuple[Piece, ...], ...]
    strategy: str
    attn_weight: float = 1.0
    token_weight: float = 0.0
    padding_tokens: int = 0

    def __post_init__(self) -> None:
        self._check_complete()

    @property
    def cp_size(self) -> int:
        return len(self.pieces)

    @property
    def seq_len(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    def doc_start(self, doc: int) -> int:
        return self.cu_seqlens[doc]

    def local_len(self, rank: int) -> int:
        return sum(len(p) for p in self.pieces[rank])

    @functools.cache  # noqa: B019 - the layout is frozen and small; caching per instance is the point
    def positions(self, rank: int) -> torch.Tensor:
        """Global token positions [local_len] held by ``rank``, in local order."""
        parts = [
            torch.arange(self.cu_seqlens[p.doc] + p.start, self.cu_seqlens[p.doc] + p.end)
            for p in self.pieces[rank]
        ]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def piece_cost(self, piece: Piece) -> float:
        s, e = piece.start, piece.end
        return self.attn_weight * (e * (e + 1) - s * (s + 1)) / 2 + self.token_weight * (e - s)

    def rank_costs(self) -> list[float]:
        return [sum(self.piece_cost(p) for p in pcs) for pcs in self.pieces]

    def rank_pairs(self) -> list[int]:
        """Per rank, its causal query-key pairs: a token at offset ``i`` is the query of ``i + 1``."""
        return [
            sum((p.end * (p.end + 1) - p.start * (p.start + 1)) // 2 for p in pcs)
            for pcs in self.pieces
        ]

    @property
    def compute_imbalance(self) -> float:
        """max / mean of the per-rank cost under the layout's weights (1.0 is perfect)."""
        return _imbalance(self.rank_costs())

    @property
    def pair_imbalance(self) -> float:
        """max / mean of the per-rank causal attention pairs: what attention layers wait for."""
        return _imbalance(self.rank_pairs())

    @property
    def token_imbalance(self) -> float:
        """max / mean of the per-rank token count: what every other layer waits for."""
        return _imbalance([self.local_len(r) for r in range(self.cp_size)])

    def step_time_ratio(self, pair_cost: float, token_cost: float) -> float:
        """Step time over the ideal one under the per-layer model: the ranks meet at every layer,
        so attention layers last as long as the rank with the most pairs and the other layers as
        the rank with the most tokens. ``pair_cost`` / ``token_cost``: the work of one causal
        pair (summed over the attention layers) and of one token (over all layers), in any one
        unit. ``(a·max pairs + b·max tokens) / (a·mean pairs + b·mean tokens)``."""
        pairs, tokens = self.rank_pairs(), [self.local_len(r) for r in range(self.cp_size)]
        ideal = pair_cost * sum(pairs) / self.cp_size + token_cost * sum(tokens) / self.cp_size
        if ideal == 0:
            return 1.0
        return (pair_cost * max(pairs) + token_cost * max(tokens)) / ideal

    @property
    def balance_misses(self) -> tuple[str, ...]:
        """The balance bounds this layout misses, each with by how much (empty: all met):
        pairs ≤ ``PAIR_BOUND`` × mean and tokens ≤ ``TOKEN_BOUND`` × mean on every rank."""
        misses = []
        for name, value, bound in (
            ("pairs", self.pair_imbalance, PAIR_BOUND),
            ("tokens", self.token_imbalance, TOKEN_BOUND),
        ):
            if value > bound:
                misses.append(f"{name} imbalance {value:.4f} > {bound} (+{value - bound:.4f})")
        return tuple(misses)

    @property
    def kv_rows_received(self) -> tuple[int, ...]:
        """Per rank, the K/V rows it receives (:meth:`kv_rows_needed`)."""
        return tuple(self.kv_rows_needed(r) for r in range(self.cp_size))

    @property
    def kv_fraction(self) -> float:
        """K/V rows received summed over ranks, over what an all-gather of the sequence moves."""
        gathered = sum(self.all_gather_kv_bytes(1))
        return sum(self.kv_rows_received) / gathered if gathered else 0.0

    def kv_rows_needed(self, rank: int) -> int:
        """K/V rows ``rank`` must receive: for each document it holds, the document's tokens
        before the end of its last local piece that live on other ranks."""
        last_end: dict[int, int] = {}
        owned: dict[int, int] = {}
        for p in self.pieces[rank]:
            last_end[p.doc] = max(last_end.get(p.doc, 0), p.end)
            owned[p.doc] = owned.get(p.doc, 0) + len(p)
        return sum(last_end[d] - owned[d] for d in last_end)

    def kv_bytes(self, bytes_per_token: int) -> list[int]:
        """Per rank, bytes of K/V received when only the needed pieces are sent."""
        return [self.kv_rows_needed(r) * bytes_per_token for r in range(self.cp_size)]

    def all_gather_kv_bytes(self, bytes_per_token: int) -> list[int]:
        """Per rank, bytes of K/V received by an all-gather of the whole sequence."""
        return [(self.seq_len - self.local_len(r)) * bytes_per_token for r in range(self.cp_size)]

    def as_tensor(self) -> torch.Tensor:
        """[n_pieces, 4] int64 rows (rank, doc, start, end): cheap to broadcast or compare."""
        rows = [(r, p.doc, p.start, p.end) for r, pcs in enumerate(self.pieces) for p in pcs]
        return torch.tensor(rows, dtype=torch.long).reshape(-1, 4)

    def _check_complete(self) -> None:
        cu = self.cu_seqlens
        if len(cu) < 1 or cu[0] != 0 or any(b <= a for a, b in itertools.pairwise(cu)):
            raise ValueError(
                f"cu_seqlens must start at 0 and increase strictly, got {list(cu)[:16]}"
            )
        seen = [0] * self.num_docs
        for rank, pcs in enumerate(self.pieces):
            order = [cu[p.doc] + p.start for p in pcs]
            if order != sorted(order):
                raise ValueError(f"rank {rank}: pieces must be in global order")
            for p in pcs:
                if not (
                    0 <= p.doc < self.num_docs and 0 <= p.start < p.end <= cu[p.doc + 1] - cu[p.doc]
                ):
                    raise ValueError(f"rank {rank}: piece {p} is empty or outside its document")
                seen[p.doc] += len(p)
        for d, n in enumerate(seen):
            if n != cu[d + 1] - cu[d]:
                raise ValueError(
                    f"document {d}: pieces cover {n} of its {cu[d + 1] - cu[d]} tokens"
                )


def _imbalance(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def shard_sequence(tensor: torch.Tensor, layout: CPLayout, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a per-token tensor (``tensor.shape[dim] == layout.seq_len``)."""
    if tensor.shape[dim] != layout.seq_len:
        raise ValueError(
            f"shard_sequence: dim {dim} has {tensor.shape[dim]} tokens, the layout covers {layout.seq_len}"
        )
    if not 0 <= rank < layout.cp_size:
        raise ValueError(f"rank {rank} outside the layout's {layout.cp_size} ranks")
    return tensor.index_select(dim, layout.positions(rank).to(tensor.device))


def unshard_sequence(shards: list[torch.Tensor], layout: CPLayout, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: every rank's shard (in rank order) → the full tensor.

    Differentiable (an index copy), so it also serves as a reference in tests.
    """
    if len(shards) != layout.cp_size:
        raise ValueError(
            f"unshard_sequence: got {len(shards)} shards for a layout of {layout.cp_size} ranks"
        )
    for r, s in enumerate(shards):
        if s.shape[dim] != layout.local_len(r):
            raise ValueError(
                f"unshard_sequence: shard {r} has {s.shape[dim]} tokens along dim {dim}, expected {layout.local_len(r)}"
            )
    cat = torch.cat(shards, dim)
    order = torch.cat([layout.positions(r) for r in range(layout.cp_size)]).to(cat.device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return cat.index_select(dim, inverse)
