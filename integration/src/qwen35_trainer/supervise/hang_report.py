"""The launcher's last line after a hang: which rank stopped answering.

Every live rank of a hung job writes ``<output_dir>/hang/rank<r>.txt``
(:mod:`qwen35_trainer.supervise.watchdog`), its first line naming the step and the phase it
waited in. A rank that wrote nothing is the one that stopped: a stopped process, one stuck
outside Python, or one that died without a word. When every rank wrote its stacks (they all
waited on something outside the job: the file system, a device), no rank is singled out.
"""

from __future__ import annotations

import re
from pathlib import Path

from qwen35_trainer.supervise.watchdog import HANG_FOLDER

__all__ = ["hang_report"]


def hang_report(output_dir: str | None, world: int) -> str:
    """One line naming the rank(s) that hung, what the others waited in, and where the stacks
    are."""
    if output_dir is None:
        return "a rank made no progress for train.hang_timeout (no run folder: stacks on stderr)"
    folder = Path(output_dir) / HANG_FOLDER
    heads = {}
    for path in sorted(folder.glob("rank*.txt")):
        match = re.fullmatch(r"rank(\d+)\.txt", path.name)
        if match:
            with open(path) as f:
                heads[int(match.group(1))] = f.readline().strip()
    silent = [r for r in range(world) if r not in heads]
    waited = sorted({head.split("waiting in: ", 1)[-1] for head in heads.values()})
    steps = sorted({m.group(1) for h in heads.values() if (m := re.search(r"at step (\d+)", h))})
    others = f"ranks {sorted(heads)} waited at step {', '.join(steps)} in: {'; '.join(waited)}"
    if not silent:
        return f"every rank made no progress ({others}); stacks in {folder}"
    names = ", ".join(str(r) for r in silent)
    return (
        f"rank {names} stopped answering (it wrote no stacks: stopped, stuck outside Python, or "
        f"dead); {others}; their stacks are in {folder}"
    )
