"""Packed rows train exactly like right-padded rows: documents never see each other.

The same samples, once as right-padded rows (transformers' own masking, the path proven equal to
transformers' model in test_model.py) and once packed into one row through
:func:`enable_packing`: loss, aux loss and every gradient agree. Without the adaptation the
packed row leaks across documents and the loss differs (negative control).
"""

from __future__ import annotations

import copy

import torch
from helpers import tiny

from dist_testkit import assert_close, assert_grads_close
from qwen35_trainer import TrainingObjective, build_model
from qwen35_trainer.data import IGNORE_INDEX, collate, rank_samples
from qwen35_trainer.data.packing import pack
from qwen35_trainer.model.objective import shifted_labels
from qwen35_trainer.model.packed import enable_packing


def _setup():
    """(model, samples, the samples as padded rows, the samples as one packed row)."""
    r = tiny("model.expert_backend=torch")
    model = build_model(r.model)
    samples = rank_samples(r.model, r.data, step=0, rank=0, dp=1)
    padded = collate(samples, pad_token_id=0)
    row = pack(samples, model.config, pad_token_id=0)
    return model, samples, padded, row


def _loss(shares):
    return shares.ce + 0.001 * shares.aux


def test_packed_row_equals_padded_rows_values_and_grads():
    model, _, padded, row = _setup()
    reference = TrainingObjective(copy.deepcopy(model))
    enable_packing(model)
    packed = TrainingObjective(model)
    ref = reference(padded)
    ours = packed(row[0], packed=row[1])
    assert ours.tokens == ref.tokens == int((shifted_labels(padded) != IGNORE_INDEX).sum())
    assert_close(ours.ce, ref.ce, rtol=1e-5, atol=1e-6, name="ce")
    assert_close(ours.aux, ref.aux, rtol=1e-6, atol=1e-7, name="aux")
    _loss(ours).backward()
    _loss(ref).backward()
    assert_grads_close(packed, reference, rtol=1e-4, atol=1e-6)


def test_without_the_adaptation_documents_leak():
    """Negative control: transformers' own layers on the packed row (causal over the whole row,
    GDN state carried across documents) give a different loss."""
    model, _, padded, row = _setup()
    objective = TrainingObjective(model)
    ref = objective(padded).ce
    leaked = objective(row[0]).ce  # plain causal row, no packing adaptation
    assert abs(leaked.item() - ref.item()) > 1e-3, (leaked.item(), ref.item())


def test_pack_layout():
    _, samples, _, (batch, packed) = _setup()
    lengths = [s.input_ids.numel() for s in samples]
    cu = list(packed.layout.cu_seqlens)
    assert cu[: len(lengths) + 1] == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert cu[-1] == batch.input_ids.shape[1] and cu[-1] % 8 == 0
    for start in cu[:-1]:
        assert batch.labels[0, start] == IGNORE_INDEX  # never predicted across a boundary
        assert (packed.position_ids[:, 0, start] == 0).all()  # each document starts at position 0
    assert torch.equal(batch.pixel_values, torch.cat([s.pixel_values for s in samples]))
    assert batch.attention_mask[0, : sum(lengths)].all()
    assert not batch.attention_mask[0, sum(lengths) :].any()
