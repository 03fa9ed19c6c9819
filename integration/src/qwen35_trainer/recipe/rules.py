"""The rule helpers every recipe section checks its values with."""

from __future__ import annotations

from typing import Any

__all__ = ["is_int", "refuse"]


def refuse(section: str, rules: dict[str, tuple[bool, str]], values: Any) -> None:
    """One ``ValueError`` naming every field of ``section`` whose rule fails."""
    bad = [
        f"{section}.{name} must be {what}, got {getattr(values, name)!r}"
        for name, (ok, what) in rules.items()
        if not ok
    ]
    if bad:
        raise ValueError("; ".join(bad))


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
