"""Packing and the three equivalent descriptions of a packed sequence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_varlen_attn import (
    PackedBatch,
    cu_seqlens_from_doc_ids,
    doc_ids_from_cu_seqlens,
    doc_ids_from_indexed_mask,
    indexed_mask_from_doc_ids,
    pack_documents,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(50, 120))
def test_pack_documents_places_every_token_once_within_capacity(lengths, capacity):
    bins = pack_documents(lengths, capacity)
    assert bins == pack_documents(lengths, capacity)  # deterministic
    covered = {}
    for b in bins:
        assert sum(e - s for _, s, e in b) <= capacity
        for d, s, e in b:
            covered.setdefault(d, []).append((s, e))
    assert sorted(covered) == list(range(len(lengths)))
    for d, parts in covered.items():
        assert parts == [(0, lengths[d])]
    # first-fit decreasing never opens a bin while an earlier one had room for the item
    assert len(bins) <= len(lengths)


def test_pack_documents_long_documents():
    with pytest.raises(ValueError, match="more than the capacity 10"):
        pack_documents([3, 25], 10)
    bins = pack_documents([3, 25], 10, split_long=True)
    parts = sorted((d, s, e) for b in bins for d, s, e in b)
    assert parts == [(0, 0, 3), (1, 0, 10), (1, 10, 20), (1, 20, 25)]
    with pytest.raises(ValueError, match="lengths must be positive"):
        pack_documents([3, 0], 10)
    with pytest.raises(ValueError, match="capacity must be positive"):
        pack_documents([3], 0)


def test_packed_batch_from_documents():
    docs = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    b = PackedBatch.from_documents(docs, 8, pad_token_id=0)
    assert b.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 0, 0]
    assert b.doc_ids.tolist() == [1, 1, 1, 2, 3, 3, 0, 0]
    assert b.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 0, 1]
    # the model shifts labels: the first token of each document must not be predicted from the previous one
    assert b.labels.tolist() == [-100, 6, 7, -100, -100, 10, -100, -100]
    assert b.cu_seqlens.dtype == torch.int32
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6, 8]
    assert b.max_seqlen == 3
    with pytest.raises(ValueError, match="more than the capacity 4"):
        PackedBatch.from_documents(docs, 4)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        PackedBatch.from_documents([torch.zeros(2, 2)])


def test_interior_padding_is_its_own_segment():
    ids = torch.arange(7)
    doc = torch.tensor([1, 1, 0, 0, 2, 2, 2])
    b = PackedBatch.from_doc_ids(ids, doc)
    assert b.cu_seqlens.tolist() == [0, 2, 4, 7]
    assert b.labels.tolist() == [-100, 1, -100, -100, -100, 5, 6]
    assert b.position_ids.tolist() == [0, 1, 0, 1, 0, 1, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), min_size=1, max_size=12))
def test_converters_round_trip(runs):
    ids, next_id = [], 1
    for is_pad, n in runs:
        if is_pad:
            ids += [0] * n
        else:
            ids += [next_id] * n
            next_id += 1
    doc_ids = torch.tensor(ids)
    mask = indexed_mask_from_doc_ids(doc_ids)
    assert torch.equal(doc_ids_from_indexed_mask(mask), mask)
    assert torch.equal(mask != 0, doc_ids != 0)
    cu = cu_seqlens_from_doc_ids(doc_ids)
    assert int(cu[-1]) == len(ids)
    seg = doc_ids_from_cu_seqlens(cu)
    # same boundaries: a new segment starts exactly where the id changes
    starts_a = torch.ones(len(ids), dtype=torch.bool)
    starts_a[1:] = doc_ids[1:] != doc_ids[:-1]
    starts_b = torch.ones(len(ids), dtype=torch.bool)
    starts_b[1:] = seg[1:] != seg[:-1]
    assert torch.equal(starts_a, starts_b)


def test_converter_errors():
    with pytest.raises(ValueError, match="1, 2, … in order"):
        doc_ids_from_indexed_mask(torch.tensor([1, 1, 3, 3]))
    with pytest.raises(ValueError, match="strictly increasing"):
        doc_ids_from_cu_seqlens(torch.tensor([0, 3, 3, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="start at 0"):
        doc_ids_from_cu_seqlens(torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D"):
        cu_seqlens_from_doc_ids(torch.zeros(2, 2))
    batch = indexed_mask_from_doc_ids(torch.tensor([[3, 3, 0, 7], [1, 0, 0, 2]]))
    assert batch.tolist() == [[1, 1, 0, 2], [1, 0, 0, 2]]
