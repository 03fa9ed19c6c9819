"""Shared test builders: the built-in tiny recipe in ONE process (its own layout is 4 ranks),
smaller where a test needs speed."""

from __future__ import annotations

from qwen35_trainer import load_recipe
from qwen35_trainer.recipe import recipe_path

TINY = recipe_path("tiny")
ONE_PROCESS = ("parallel.dp=1", "parallel.cp=1", "parallel.ep=1")


def tiny(*overrides: str):
    return load_recipe(TINY, [*ONE_PROCESS, *overrides])
