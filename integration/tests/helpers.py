"""Shared test builders: the built-in tiny recipe in ONE process (its own layout is 4 ranks) on
the synthetic stream (its own data is the demo dataset), smaller where a test needs speed."""

from __future__ import annotations

import contextlib

from qwen35_trainer import load_recipe
from qwen35_trainer.recipe import recipe_path

TINY = recipe_path("tiny")
ONE_PROCESS = ("parallel.dp=1", "parallel.cp=1", "parallel.ep=1")
SYNTHETIC = (
    "data.path=null",
    "data.processor=null",
    "data.eval_path=null",
    "data.pack_length=null",
    "train.eval_every=0",
    "train.eval_steps=1",
)


def tiny(*overrides: str):
    """The tiny recipe, one process, synthetic data; ``overrides`` apply last."""
    return load_recipe(TINY, [*ONE_PROCESS, *SYNTHETIC, *overrides])


def hf_forward(model, batch, **extra):
    """transformers' forward of a right-padded :class:`qwen35_trainer.Batch` (no cache)."""
    return model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        mm_token_type_ids=batch.mm_token_type_ids,
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw,
        use_cache=False,
        **extra,
    )


def demo_recipe(root, *overrides: str):
    """The tiny recipe, one process, on the demo dataset written under ``root``
    (:func:`qwen35_trainer.demo.dataset.make_demo`); ``overrides`` apply last."""
    return load_recipe(
        TINY,
        [
            *ONE_PROCESS,
            f"data.path={root}/train.jsonl",
            f"data.processor={root}/processor",
            f"data.eval_path={root}/heldout.jsonl",
            "data.workers=0",
            *overrides,
        ],
    )


@contextlib.contextmanager
def nan_pixels(source: str):
    """Within the block, the document read from ``source`` (``file:row``) has NaN pixel values
    (images and video frames): a fault injected after the processor, in this process."""
    import torch

    from qwen35_trainer.data.conversation import ConversationEncoder

    original = ConversationEncoder.__call__

    def encode(self, row, where, base):
        sample = original(self, row, where, base)
        if where == source:
            sample.pixel_values = torch.full_like(sample.pixel_values, float("nan"))
            sample.pixel_values_videos = torch.full_like(sample.pixel_values_videos, float("nan"))
        return sample

    ConversationEncoder.__call__ = encode
    try:
        yield
    finally:
        ConversationEncoder.__call__ = original


def media_document(recipe, step: int, rows: range | None = None) -> str:
    """The source of the first document with an image or video in step ``step`` (1-based) of
    ``recipe``'s dataset as one process reads it, within the global ``rows`` of the step."""
    import torch

    from qwen35_trainer.data.loader import DataStream
    from qwen35_trainer.model import build_config
    from qwen35_trainer.parallel import Layout

    stream = DataStream(recipe, build_config(recipe.model), Layout(), torch.device("cpu"))
    for _ in range(step - 1):
        stream.next_step()
    found = stream.next_step().rows
    for row in (found[i] for i in (rows or range(len(found)))):
        for doc in row:
            if doc.pixel_values.numel() or doc.pixel_values_videos.numel():
                return doc.source
    raise AssertionError(f"no document with media in step {step}")
