"""Layout strategies: contiguous, per-document zigzag, and balanced.

Cost model (see ``CPLayout``): a token at offset ``i`` of its document costs
``a * (i + 1) + b``; a piece ``[s, e)`` of a document holds ``P(e) - P(s)`` causal pairs with
``P(n) = n (n + 1) / 2``.

- ``contiguous``: equal consecutive chunks of the packed sequence (cheap in K/V, but the ranks
  holding late tokens of long documents do most of the attention).
- ``zigzag``: per document, 2·cp chunks, rank r takes chunks r and 2·cp−1−r (balanced, but it
  splits every document over every rank; Megatron would also pad each to a multiple of 2·cp).
- ``balanced`` (:mod:`cp_varlen_attn.balanced`): pairs AND tokens at their means on every rank,
  zero padding, and only a few documents split.

Exactness never depends on the strategy: a layout is only a permutation of tokens into pieces.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from cp_varlen_attn.balanced import plan_balanced
from cp_varlen_attn.layout import CPLayout, Piece

__all__ = ["STRATEGIES", "plan_cp_layout"]

STRATEGIES = ("contiguous", "zigzag", "balanced")

# The layout's reporting cost model (``CPLayout.compute_imbalance``); ``balanced`` itself does
# not need it, since pairs and tokens balanced separately balance every weighted sum.
# Per-token linear work (projections, MoE, GDN) in units of "one query-key pair of causal
# attention". Qwen3.5-35B-A3B does ~2·3e9 FLOPs per token in its matmuls and 4·16·256 FLOPs per
# query-key pair in each of its 10 full-attention layers: a ratio of ~37K; attention kernels run
# at roughly half the matmul FLOP rate, hence ~16K. Pass token_weight=0 for attention-only cost.
DEFAULT_TOKEN_WEIGHT = 16384.0


def plan_cp_layout(
    cu_seqlens: torch.Tensor | Sequence[int],
    cp_size: int,
    *,
    strategy: str = "balanced",
    attn_weight: float = 1.0,
    token_weight: float = DEFAULT_TOKEN_WEIGHT,
) -> CPLayout:
    """Split the packed sequence described by ``cu_seqlens`` (int [n_docs + 1]) over ``cp_size`` ranks.

    ``attn_weight`` / ``token_weight`` are the layout's reporting cost model (a token at offset
    ``i`` costs ``attn_weight * (i + 1) + token_weight``; see ``CPLayout.compute_imbalance``).
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
        per_rank = plan_balanced(lengths, cp_size)
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
