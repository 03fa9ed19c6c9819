"""The 131,072-token packs the layout claims are measured on (used by bench_layouts.py and the
acceptance test): three kinds, ten seeds each.

- ``lognormal``: document lengths log-normal with median 2,048 tokens (σ = 1.0), the last one
  cut to fill the pack — web-text-like packs of ~50 documents;
- ``one document``: a single 131,072-token document;
- ``64K + short``: one 65,536-token document plus log-normal short ones (median 1,024).
"""

from __future__ import annotations

import math
import random

SEQ = 131072
SEEDS = range(10)
KINDS = ("lognormal", "one document", "64K + short")
# K/V rows received (summed over ranks) as a fraction of an all-gather, per kind: 25 % where
# many documents share the pack; a causally balanced split of one long document inherently
# needs more (≈ 75 % for one 128K document over every rank, ≈ 45 % for one 64K among short).
KV_BOUND = {"lognormal": 0.25, "one document": 0.80, "64K + short": 0.50}


def lognormal_lengths(rng: random.Random, median: float, sigma: float, total: int) -> list[int]:
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(max(1, int(rng.lognormvariate(math.log(median), sigma))))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def pack(kind: str, seed: int) -> list[int]:
    """Document lengths of one pack (sum = SEQ)."""
    rng = random.Random(seed)
    if kind == "lognormal":
        return lognormal_lengths(rng, 2048, 1.0, SEQ)
    if kind == "one document":
        return [SEQ]
    if kind == "64K + short":
        return [65536, *lognormal_lengths(rng, 1024, 1.0, SEQ - 65536)]
    raise ValueError(f"unknown pack kind {kind!r}; expected one of {KINDS}")


def cu_of(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu
