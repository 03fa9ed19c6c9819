"""The search's output (:mod:`.search`): a line per candidate as it is decided, then the ranked
table (fastest first: predicted step time and tokens/s/GPU, with the peak, the bubble and the
bytes over nodes) and the command that plans the best layout."""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from qwen35_trainer.plan.hardware import Hardware
from qwen35_trainer.plan.planner import GIB
from qwen35_trainer.plan.search import Candidate

__all__ = ["format_candidate", "format_search"]


def _layout(c: Candidate) -> str:
    names = {"dp_replicate": "HSDP"}
    parts = [f"{names.get(k, k.upper())} {v}" for k, v in c.layout.items() if v > 1]
    return " × ".join(parts) or "one rank"


def _micro(c: Candidate) -> str:
    return "" if c.recipe is None else str(c.recipe.train.grad_accum_steps)


def format_candidate(c: Candidate) -> str:
    """One line: the layout and its verdict (planned: step time, tokens/s/GPU, peak, bubble,
    inter-node bytes)."""
    if c.plan is None:
        return f"  {_layout(c):<32} not planned: {c.reason}"
    p = c.plan
    verdict = "fits" if p.fits else "does NOT fit"
    bubble = f"{p.bubble:6.1%}" if p.bubble is not None else f"{'-':>6}"
    seconds = f"{c.time.seconds:9.2f}" if c.time else f"{'-':>9}"
    tokens = f"{c.time.tokens_per_gpu:10,.0f}" if c.time else f"{'-':>10}"
    return (
        f"  {_layout(c):<32}{_micro(c):>6}{seconds}{tokens}{p.peak_gib:10.2f}{bubble:>9}"
        f"{c.inter_node / GIB:12.2f}  {verdict}"
    )


def format_search(
    found: list[Candidate],
    recipe: str,
    overrides: list[str],
    world: int,
    gpu_gib: float,
    gpu: Hardware | None = None,
    base: Any = None,
) -> str:
    """The ranked table and the ``qwen35-train plan`` command of the best candidate (its
    overrides that change the recipe ``base``, when given)."""
    header = (
        f"  {'layout':<32}{'micro':>6}{'step s':>9}{'tok/s/GPU':>10}{'peak GiB':>10}"
        f"{'bubble':>9}{'inter-node':>12}  (GiB sent per rank and step over groups spanning nodes)"
    )
    on = f" {gpu.name}" if gpu else ""
    lines = [
        "",
        f"search: {recipe} on {world}{on} GPUs of {gpu_gib:g} GiB, fastest first",
        header,
        *(format_candidate(c) for c in found),
        "",
    ]
    if not found or not found[0].fits:
        lines.append(f"no layout of this step fits in {gpu_gib:g} GiB")
        return "\n".join(lines)
    changed = [item for item in found[0].sets if base is None or _changes(base, item)]
    sets = [a for item in [*overrides, *changed] for a in ("--set", item)]
    command = shlex.join(["qwen35-train", "plan", recipe, *sets])
    best = found[0]
    lines += [
        f"best: {_layout(best)}, predicted step {best.time.seconds:.2f} s "
        f"({best.time.tokens_per_gpu:,.0f} tokens/s/GPU), peak {best.plan.peak_gib:.2f} GiB",
        command,
    ]
    return "\n".join(lines)


def _changes(recipe: Any, item: str) -> bool:
    """Whether override ``section.key=value`` changes ``recipe``."""
    key, _, raw = item.partition("=")
    value: Any = recipe
    for part in key.split("."):
        value = getattr(value, part)
    return value != yaml.safe_load(raw)
