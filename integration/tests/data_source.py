"""A ``data.source`` for the tests: ``data_source:rows`` yields conversation rows (text only)."""

from __future__ import annotations

WORDS = ("up", "down", "left", "right")
OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}


def rows():
    for i in range(10):
        word = WORDS[i % 4]
        yield {"messages": [{"role": "user", "content": f"what is the opposite of {word}?"},
                            {"role": "assistant", "content": OPPOSITE[word]}]}  # fmt: skip
