"""The synthetic multimodal stream (the default when a recipe names no dataset).

A sample is text around images: ``text``, then per image ``<vision_start>``, one
``<image>`` placeholder per merged patch (``t*h*w / merge**2``), ``<vision_end>``, more text.
Its pixels are [t*h*w, C*T*P*P] patch rows, as the Qwen3.5 processor emits them. Text follows a
learnable rule (counting modulo the text vocabulary with a stride of 1, 2 or 3, random start per
piece), so the loss of a working trainer falls. Sample ``i`` depends only on ``(seed, i)``:
every layout sees the same global batch, and rank ``r`` of ``dp`` takes rows
``[r*n, (r+1)*n)`` of step ``s``'s global batch of ``dp*n`` samples.

Labels are the input ids with every non-text position (vision markers, image placeholders,
padding) set to ``ignore_index``; the loss shifts them by one.
"""

from __future__ import annotations

import torch

from qwen35_trainer.data.batch import IGNORE_INDEX, Batch, Sample, collate
from qwen35_trainer.recipe import DataRecipe, ModelRecipe

__all__ = [
    "HELD_OUT_INDEX",
    "global_batch",
    "max_sample_tokens",
    "rank_batch",
    "rank_samples",
    "sample",
    "text_vocab",
]


def text_vocab(model: ModelRecipe) -> int:
    """Ids below the first special (vision) token id are text."""
    return min(
        model.image_token_id,
        model.video_token_id,
        model.vision_start_token_id,
        model.vision_end_token_id,
    )


def _text(n: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    start = int(torch.randint(0, vocab, (1,), generator=g))
    stride = int(torch.randint(1, 4, (1,), generator=g))
    return (start + stride * torch.arange(n)) % vocab


def sample(model: ModelRecipe, data: DataRecipe, index: int) -> Sample:
    """Sample ``index`` of the synthetic stream (deterministic in ``data.seed`` and ``index``)."""
    vision = model.vision
    merge = vision.get("spatial_merge_size", 2)
    row = (
        vision.get("in_channels", 3)
        * vision.get("temporal_patch_size", 2)
        * vision.get("patch_size", 16) ** 2
    )
    vocab = text_vocab(model)
    g = torch.Generator().manual_seed(data.seed * 1_000_003 + index)
    lo, hi = data.text_tokens
    pieces, pixels, grids = [], [torch.zeros(0, row)], [torch.zeros(0, 3, dtype=torch.long)]
    images = data.images_per_sample
    if data.text_only is not None:
        period, count = data.text_only
        images = 0 if index % period >= period - count else images
    for _ in range(images):
        grid = data.image_grids[int(torch.randint(len(data.image_grids), (1,), generator=g))]
        t, h, w = grid
        if h % merge or w % merge:
            raise ValueError(f"data.image_grids: h and w must be multiples of {merge}, got {grid}")
        placeholders = torch.full((t * h * w // merge**2,), model.image_token_id)
        pieces += [
            _text(int(torch.randint(lo, hi + 1, (1,), generator=g)), vocab, g),
            torch.tensor([model.vision_start_token_id]),
            placeholders,
            torch.tensor([model.vision_end_token_id]),
        ]
        pixels.append(torch.randn(t * h * w, row, generator=g))
        grids.append(torch.tensor([grid]).long())
    pieces.append(_text(int(torch.randint(lo, hi + 1, (1,), generator=g)), vocab, g))
    ids = torch.cat(pieces).long()
    return Sample(
        input_ids=ids,
        labels=ids.masked_fill(ids >= vocab, IGNORE_INDEX),
        mm_token_type_ids=(ids == model.image_token_id).long(),
        pixel_values=torch.cat(pixels),
        image_grid_thw=torch.cat(grids),
        source=f"synthetic:{index}",
    )


def max_sample_tokens(model: ModelRecipe, data: DataRecipe) -> int:
    """The most tokens a sample of :func:`sample` can have: the longest text span before each
    image and after the last, each image of the largest grid with its vision start / end."""
    merge = model.vision.get("spatial_merge_size", 2) ** 2
    image = max(t * h * w for t, h, w in data.image_grids) // merge + 2
    return (data.images_per_sample + 1) * data.text_tokens[1] + data.images_per_sample * image


# Held-out samples: the stream from this index on. torch's generator seeds are 32-bit (seeds equal
# modulo 2**32 give the same sample), so this is as far from the training samples as the seed
# space allows: training would need 2**31 samples to reach them.
HELD_OUT_INDEX = 1 << 31


def rank_samples(
    model: ModelRecipe, data: DataRecipe, step: int, rank: int, dp: int, *, offset: int = 0
) -> list[Sample]:
    """Data-parallel group ``rank``'s (of ``dp``) ``data.samples_per_rank`` samples of step
    ``step`` (of the held-out stream with ``offset=HELD_OUT_INDEX``)."""
    n = data.samples_per_rank
    first = offset + (step * dp + rank) * n
    return [sample(model, data, first + j) for j in range(n)]


def rank_batch(
    model: ModelRecipe, data: DataRecipe, pad_token_id: int, step: int, rank: int, dp: int
) -> Batch:
    """Rank ``rank``'s rows of step ``step``, right-padded."""
    return collate(rank_samples(model, data, step, rank, dp), pad_token_id)


def global_batch(
    model: ModelRecipe, data: DataRecipe, pad_token_id: int, step: int, dp: int, *, offset: int = 0
) -> Batch:
    """All ``dp`` ranks' rows of step ``step`` as one batch (the single-process reference)."""
    n = data.samples_per_rank
    samples = [sample(model, data, offset + step * dp * n + j) for j in range(dp * n)]
    return collate(samples, pad_token_id)
