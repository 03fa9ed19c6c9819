"""Acceptance of ``balanced`` on 131,072-token packs: on all 90 (pack kind, CP, seed) cases of
``benchmarks/packs.py``, causal pairs ≤ 1.02 × mean and tokens ≤ 1.05 × mean on every rank, zero
padding, K/V within the kind's bound; planning one pack at CP 32 is fast; the GDN prefix
exchange stays within ⌈log2 cp⌉ + 1 summaries per document a rank holds."""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import pytest

from cp_varlen_attn import PAIR_BOUND, TOKEN_BOUND, plan_cp_layout, plan_summaries

_spec = importlib.util.spec_from_file_location(
    "packs", Path(__file__).parents[1] / "benchmarks" / "packs.py"
)
packs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(packs)


@pytest.mark.parametrize("cp", [8, 16, 32])
@pytest.mark.parametrize("kind", packs.KINDS)
def test_balanced_bounds_on_every_seed(kind, cp):
    for seed in packs.SEEDS:
        layout = plan_cp_layout(packs.cu_of(packs.pack(kind, seed)), cp)
        where = f"{kind}, cp {cp}, seed {seed}"
        assert layout.pair_imbalance <= PAIR_BOUND, where
        assert layout.token_imbalance <= TOKEN_BOUND, where
        assert layout.padding_tokens == 0, where
        assert layout.kv_fraction <= packs.KV_BOUND[kind], where
        assert layout.balance_misses == (), where


def test_planning_one_pack_at_cp32_is_fast():
    cu = packs.cu_of(packs.pack("lognormal", 0))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        plan_cp_layout(cu, 32)
        times.append(time.perf_counter() - start)
    # 50 ms is the claim (benchmarks/bench_layouts.py prints it); CI machines are shared.
    assert sorted(times)[2] < 0.2


@pytest.mark.parametrize("cp", [8, 32])
def test_prefix_exchange_is_logarithmic(cp):
    """A run (consecutive pieces of a document on one rank) of a document with m runs receives
    at most 1 + ⌈log2(m − 1)⌉ summaries: ⌈log2 cp⌉ + 1 per document where every rank holds one
    run of it (contiguous), twice ⌈log2(2·cp − 2)⌉ + 1 where ranks hold a head and a tail."""
    for strategy in ("contiguous", "balanced", "zigzag"):
        for kind in packs.KINDS:
            layout = plan_cp_layout(packs.cu_of(packs.pack(kind, 0)), cp, strategy=strategy)
            plan = plan_summaries(layout)
            for doc, runs in plan.runs.items():
                per_run = 1 + math.ceil(math.log2(len(runs) - 1)) if len(runs) > 1 else 0
                for rank in {r for r, _ in runs}:
                    got = sum(
                        m.dst == rank != m.src and m.doc == doc
                        for msgs in plan.rounds
                        for m in msgs
                    )
                    held = sum(r == rank for r, _ in runs)
                    assert got <= held * per_run, (strategy, kind, rank, doc, got)
                    if strategy == "contiguous":
                        assert got <= math.ceil(math.log2(cp)) + 1
