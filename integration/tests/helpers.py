"""Shared test builders: the built-in tiny recipe in ONE process (its own layout is 4 ranks) on
the synthetic stream (its own data is the demo dataset), smaller where a test needs speed."""

from __future__ import annotations

from qwen35_trainer import load_recipe
from qwen35_trainer.recipe import recipe_path

TINY = recipe_path("tiny")
ONE_PROCESS = ("parallel.dp=1", "parallel.cp=1", "parallel.ep=1")
SYNTHETIC = ("data.path=null", "data.processor=null", "data.eval_path=null",
             "data.pack_length=null", "train.eval_every=0", "train.eval_steps=1")  # fmt: skip


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
    (:func:`qwen35_trainer.data.demo.make_demo`); ``overrides`` apply last."""
    return load_recipe(TINY, [*ONE_PROCESS, f"data.path={root}/train.jsonl",
                              f"data.processor={root}/processor",
                              f"data.eval_path={root}/heldout.jsonl", "data.workers=0",
                              *overrides])  # fmt: skip
