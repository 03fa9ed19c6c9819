"""The search's output (:mod:`.search`): a line per candidate as it is decided, then the ranked
table and the command that plans the best layout."""

from __future__ import annotations

import shlex

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
    """One line: the layout and its verdict (planned: peak, bubble, inter-node bytes)."""
    if c.plan is None:
        return f"  {_layout(c):<32} not planned: {c.reason}"
    p = c.plan
    verdict = "fits" if p.fits else "does NOT fit"
    bubble = f"{p.bubble:6.1%}" if p.bubble is not None else f"{'-':>6}"
    return (
        f"  {_layout(c):<32}{_micro(c):>6}{p.peak_gib:10.2f}{bubble:>9}"
        f"{c.inter_node / GIB:12.2f}  {verdict}"
    )


def format_search(
    found: list[Candidate], recipe: str, overrides: list[str], world: int, gpu_gib: float
) -> str:
    """The ranked table and the ``qwen35-train plan`` command of the best candidate."""
    header = (
        f"  {'layout':<32}{'micro':>6}{'peak GiB':>10}{'bubble':>9}{'inter-node':>12}"
        "  (GiB sent per rank and step over groups spanning nodes)"
    )
    lines = [
        "",
        f"search: {recipe} on {world} GPUs of {gpu_gib:g} GiB, best first",
        header,
        *(format_candidate(c) for c in found),
        "",
    ]
    if not found or not found[0].fits:
        lines.append(f"no layout of this step fits in {gpu_gib:g} GiB")
        return "\n".join(lines)
    sets = [a for item in [*overrides, *found[0].sets] for a in ("--set", item)]
    command = shlex.join(["qwen35-train", "plan", recipe, *sets])
    lines += [
        f"best: {_layout(found[0])}, predicted peak {found[0].plan.peak_gib:.2f} GiB",
        command,
    ]
    return "\n".join(lines)
