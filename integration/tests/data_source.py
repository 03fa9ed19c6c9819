"""A ``data.source`` for the tests: ``data_source:rows`` yields conversation rows (text only)."""

from __future__ import annotations

WORDS = ("up", "down", "left", "right")
OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}


def rows():
    for i in range(10):
        word = WORDS[i % 4]
        yield {
            "messages": [
                {"role": "user", "content": f"what is the opposite of {word}?"},
                {"role": "assistant", "content": OPPOSITE[word]},
            ]
        }


def with_bad_row():
    """Like :func:`rows`, but position 3 names an image that does not exist."""
    for i, row in enumerate(rows()):
        if i == 3:
            row["messages"][0]["content"] = [{"type": "image", "path": "missing.png"}]
        yield row
