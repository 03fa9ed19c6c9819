"""Shared test builders: the repository's tiny recipe, smaller where a test needs speed."""

from __future__ import annotations

from pathlib import Path

from qwen35_trainer import load_recipe

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml"


def tiny(*overrides: str):
    return load_recipe(TINY, overrides)
