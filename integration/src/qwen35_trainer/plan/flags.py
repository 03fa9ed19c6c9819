"""The planner's ``NAME=VALUE`` flags (``--headroom``, ``--efficiency``, ``--gpu-set``): each item
read as a float for a named field, one message naming the flag, the item, the names and the
bound for a bad one."""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["named_values"]


def named_values(
    items: Iterable[str], names: list[str], flag: str, valid: Callable[[float], bool], bound: str
) -> dict[str, float]:
    """``{NAME: VALUE}`` of ``items`` (``NAME=VALUE`` each, ``NAME`` one of ``names``, ``VALUE``
    a float for which ``valid`` holds, ``bound`` saying which); ``ValueError`` otherwise."""
    values = {}
    for item in items:
        name, _, raw = item.partition("=")
        try:
            value = float(raw)
        except ValueError:
            value = None
        if name not in names or value is None or not valid(value):
            raise ValueError(
                f"{flag} {item!r}: expected NAME=VALUE with NAME one of {names} and {bound}"
            )
        values[name] = value
    return values
