"""Planner properties: every token owned exactly once, pieces contiguous inside one document and
in document order, sharding then unsharding is the identity; ``balanced`` meets its bounds; the
layout's reports equal an independent token-by-token recount."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import cu_from_lengths

from cp_varlen_attn import (
    PAIR_BOUND,
    STRATEGIES,
    TOKEN_BOUND,
    Piece,
    plan_cp_layout,
    shard_sequence,
    unshard_sequence,
)

lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=25)


@settings(max_examples=80, deadline=None)
@given(lengths_st, st.integers(1, 6), st.sampled_from(STRATEGIES))
def test_every_token_owned_once_and_round_trip(lengths, cp, strategy):
    cu = cu_from_lengths(lengths)
    layout = plan_cp_layout(cu, cp, strategy=strategy)
    assert layout == plan_cp_layout(cu, cp, strategy=strategy)  # deterministic
    owned = torch.cat([layout.positions(r) for r in range(cp)])
    assert sorted(owned.tolist()) == list(range(cu[-1]))
    for pieces in layout.pieces:
        for p in pieces:
            assert 0 <= p.start < p.end <= lengths[p.doc]
    x = torch.randn(2, cu[-1], 3)
    shards = [shard_sequence(x, layout, r, dim=1) for r in range(cp)]
    assert torch.equal(unshard_sequence(shards, layout, dim=1), x)


@settings(max_examples=40, deadline=None)
@given(lengths_st, st.integers(1, 6))
def test_balanced_needs_no_padding_and_measures_itself(lengths, cp):
    layout = plan_cp_layout(cu_from_lengths(lengths), cp, strategy="balanced")
    assert layout.padding_tokens == 0
    costs = layout.rank_costs()
    assert layout.compute_imbalance == pytest.approx(max(costs) / (sum(costs) / cp))
    # K/V received only for split documents, never more than an all-gather
    for r in range(cp):
        assert layout.kv_rows_needed(r) <= layout.seq_len - layout.local_len(r)


def test_zigzag_reports_megatron_padding_and_contiguous_is_contiguous():
    cu = cu_from_lengths([5, 8, 1])
    zz = plan_cp_layout(cu, 2, strategy="zigzag")
    assert zz.padding_tokens == (4 - 5 % 4) + 0 + 3
    assert zz.pieces[0][0] == Piece(0, 0, 1)  # head chunk of document 0
    ct = plan_cp_layout(cu, 2, strategy="contiguous")
    assert [layout.tolist() for layout in (ct.positions(0), ct.positions(1))] == [
        list(range(7)),
        list(range(7, 14)),
    ]


def test_kv_rows_needed_counts_earlier_foreign_tokens():
    cu = cu_from_lengths([10])
    ct = plan_cp_layout(cu, 2, strategy="contiguous")
    assert [ct.kv_rows_needed(r) for r in range(2)] == [0, 5]
    zz = plan_cp_layout(cu, 2, strategy="zigzag")  # rank 0: [0,2)+[7,10); rank 1: [2,7)
    assert [zz.kv_rows_needed(r) for r in range(2)] == [5, 2]


def test_one_long_document_is_balanced_exactly():
    layout = plan_cp_layout(cu_from_lengths([4096]), 4, strategy="balanced")
    assert layout.pair_imbalance < 1.001
    assert layout.token_imbalance == 1.0


def test_short_documents_stay_whole():
    layout = plan_cp_layout(cu_from_lengths([100] * 16), 4, strategy="balanced")
    assert all(p.start == 0 and p.end == 100 for pcs in layout.pieces for p in pcs)
    assert sum(layout.kv_bytes(1)) == 0
    assert layout.compute_imbalance == pytest.approx(1.0)
    assert layout.balance_misses == ()


def test_bad_input():
    with pytest.raises(ValueError, match="increase strictly"):
        plan_cp_layout([0, 4, 4, 9], 2)
    with pytest.raises(ValueError, match="start at 0"):
        plan_cp_layout([1, 4], 2)
    with pytest.raises(ValueError, match="cp_size must be a positive int"):
        plan_cp_layout([0, 4], 0)
    with pytest.raises(ValueError, match="unknown strategy 'ring'"):
        plan_cp_layout([0, 4], 2, strategy="ring")
    with pytest.raises(ValueError, match="1-D"):
        plan_cp_layout(torch.zeros(2, 2, dtype=torch.int32), 2)
    layout = plan_cp_layout([0, 4, 9], 2)
    with pytest.raises(ValueError, match="dim 1 has 8 tokens, the layout covers 9"):
        shard_sequence(torch.zeros(1, 8), layout, 0)
    with pytest.raises(ValueError, match="rank 2 outside"):
        shard_sequence(torch.zeros(1, 9), layout, 2)
    with pytest.raises(ValueError, match="got 1 shards"):
        unshard_sequence([torch.zeros(1, 4)], layout)


def _recount(layout):
    """Per rank: causal pairs, tokens and K/V rows needed, counted token by token."""
    cu = layout.cu_seqlens
    doc_of = {}
    for d in range(layout.num_docs):
        for pos in range(cu[d], cu[d + 1]):
            doc_of[pos] = d
    owner = {}
    for r in range(layout.cp_size):
        for pos in layout.positions(r).tolist():
            owner[pos] = r
    pairs, tokens, kv = [], [], []
    for r in range(layout.cp_size):
        mine = layout.positions(r).tolist()
        pairs.append(sum(pos - cu[doc_of[pos]] + 1 for pos in mine))
        tokens.append(len(mine))
        needed = {key for pos in mine for key in range(cu[doc_of[pos]], pos + 1) if owner[key] != r}
        kv.append(len(needed))
    return pairs, tokens, kv


def _imb(values):
    return max(values) / (sum(values) / len(values)) if sum(values) else 1.0


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.integers(1, 6), st.sampled_from(STRATEGIES))
def test_reports_equal_an_independent_recount(lengths, cp, strategy):
    layout = plan_cp_layout(cu_from_lengths(lengths), cp, strategy=strategy)
    pairs, tokens, kv = _recount(layout)
    assert layout.rank_pairs() == pairs
    assert layout.pair_imbalance == pytest.approx(_imb(pairs))
    assert layout.token_imbalance == pytest.approx(_imb(tokens))
    assert list(layout.kv_rows_received) == kv
    gathered = sum(layout.seq_len - n for n in tokens)
    assert layout.kv_fraction == pytest.approx(sum(kv) / gathered if gathered else 0.0)
    a, b = 3.0, 7.0
    ideal = (a * sum(pairs) + b * sum(tokens)) / cp
    assert layout.step_time_ratio(a, b) == pytest.approx((a * max(pairs) + b * max(tokens)) / ideal)
    missed = [
        name
        for name, v, bound in (
            ("pairs", _imb(pairs), PAIR_BOUND),
            ("tokens", _imb(tokens), TOKEN_BOUND),
        )
        if v > bound
    ]
    assert [m.split()[0] for m in layout.balance_misses] == missed


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.integers(1, 8))
def test_balanced_pieces_are_few_and_in_document_order(lengths, cp):
    layout = plan_cp_layout(cu_from_lengths(lengths), cp, strategy="balanced")
    cu = layout.cu_seqlens
    split = set()
    for pieces in layout.pieces:
        per_doc = {}
        for p, q in itertools.pairwise(pieces):
            assert cu[p.doc] + p.end <= cu[q.doc] + q.start  # global order, no overlap
            assert not (p.doc == q.doc and p.end == q.start)  # touching pieces are merged
        for p in pieces:
            per_doc[p.doc] = per_doc.get(p.doc, 0) + 1
            if len(p) < lengths[p.doc]:
                split.add(p.doc)
        assert max(per_doc.values(), default=0) <= 2  # a head and a tail at most
    assert len(split) <= 2 * (cp - 1)


# Packs big enough for the bounds: documents of 1..3000 tokens, at least 256 tokens per rank.
big_pack_st = st.lists(st.integers(1, 3000), min_size=1, max_size=80).filter(
    lambda x: sum(x) >= 256 * 8
)


@settings(max_examples=60, deadline=None)
@given(big_pack_st, st.sampled_from([2, 3, 4, 8]))
def test_balanced_meets_both_bounds_on_random_packs(lengths, cp):
    layout = plan_cp_layout(cu_from_lengths(lengths), cp, strategy="balanced")
    assert layout.balance_misses == ()
    assert layout.pair_imbalance <= PAIR_BOUND and layout.token_imbalance <= TOKEN_BOUND
    assert layout.padding_tokens == 0


def test_a_pack_that_cannot_be_balanced_says_so():
    layout = plan_cp_layout(cu_from_lengths([1, 1, 1]), 4, strategy="balanced")
    assert layout.local_len(3) == 0 or layout.token_imbalance > TOKEN_BOUND
    (miss,) = [m for m in layout.balance_misses if m.startswith("tokens")]
    assert f"> {TOKEN_BOUND}" in miss and "(+" in miss
