"""The synthetic multimodal stream: structure the model expects, determinism, DP split."""

from __future__ import annotations

import torch
from helpers import tiny

from qwen35_trainer import global_batch, rank_batch
from qwen35_trainer.data import IGNORE_INDEX, sample


def test_sample_structure_matches_the_processor_layout():
    r = tiny("data.images_per_sample=2")
    m = r.model
    for i in range(5):
        s = sample(m, r.data, i)
        ids = s.input_ids
        tokens_per_image = (s.image_grid_thw.prod(-1) // 4).tolist()
        assert (ids == m.image_token_id).sum() == sum(tokens_per_image)
        assert s.pixel_values.shape == (int(s.image_grid_thw.prod(-1).sum()), 3 * 2 * 2 * 2)
        starts = (ids == m.vision_start_token_id).nonzero().flatten().tolist()
        assert len(starts) == 2
        for start, n in zip(starts, tokens_per_image, strict=True):
            assert (ids[start + 1 : start + 1 + n] == m.image_token_id).all()
            assert ids[start + 1 + n] == m.vision_end_token_id
        assert torch.equal(ids, sample(m, r.data, i).input_ids)  # deterministic


def test_labels_cover_text_only_and_padding_is_masked():
    r = tiny()
    b = rank_batch(r.model, r.data, 0, step=0, rank=0, dp=1)
    text = (b.attention_mask == 1) & (b.input_ids < r.model.image_token_id)
    assert torch.equal(b.labels != IGNORE_INDEX, text)
    assert torch.equal(b.mm_token_type_ids.bool(), b.input_ids == r.model.image_token_id)
    lengths = b.attention_mask.sum(1)
    assert len(set(lengths.tolist())) > 1  # rows of different lengths: real padding


def test_rank_batches_partition_the_global_batch():
    r = tiny()
    whole = global_batch(r.model, r.data, 0, step=1, dp=2)
    parts = [rank_batch(r.model, r.data, 0, step=1, rank=k, dp=2) for k in range(2)]
    rows = [
        row[m.bool()] for p in parts for row, m in zip(p.input_ids, p.attention_mask, strict=True)
    ]
    expected = [row[m.bool()] for row, m in zip(whole.input_ids, whole.attention_mask, strict=True)]
    assert len(rows) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(rows, expected, strict=True))
    assert torch.equal(torch.cat([p.pixel_values for p in parts]), whole.pixel_values)
    assert torch.equal(torch.cat([p.image_grid_thw for p in parts]), whole.image_grid_thw)


def test_the_longest_sample_bound_is_tight():
    """:func:`max_sample_tokens` (the planner's row size without packing) bounds every sample
    and is reached when every draw takes its largest value."""
    import dataclasses

    from qwen35_trainer.data.synthetic import max_sample_tokens

    r = tiny()
    bound = max_sample_tokens(r.model, r.data)
    assert max(len(sample(r.model, r.data, i)) for i in range(200)) <= bound
    grid = max(r.data.image_grids, key=lambda g: g[0] * g[1] * g[2])
    hi = r.data.text_tokens[1]
    fixed = dataclasses.replace(r.data, image_grids=(grid,), text_tokens=(hi, hi))
    assert len(sample(r.model, fixed, 0)) == max_sample_tokens(r.model, fixed) == bound
