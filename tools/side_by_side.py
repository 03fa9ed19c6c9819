"""Test suites run side by side (the noxfile's ``tests`` session): streams of suites, each stream
in its own thread running its suites one after another, every stream at once.

Why: the trainer's suite keeps the two cores of the CI machine busy only 1.8 of its 25 minutes
long, and the package suites, run one after another before it, 1.4 (a gloo launch waits on its
slowest rank, a one-process test uses one core). Beside the trainer's suite, the package suites
fill what it leaves idle instead of adding their own minutes to it.

A suite is a list of commands run in order in one folder (its pytest run, then any re-run
against another release of a dependency); it fails at its first failing command. Its output
goes to a log file and is printed whole, under one heading with its time and verdict, when the
suite ends, so the suites' lines never interleave.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import threading
import time
from pathlib import Path

__all__ = ["Ended", "Suite", "environment", "run_streams"]


@dataclasses.dataclass
class Suite:
    """``commands`` (argument lists) run one after another in ``cwd`` with ``env``."""

    name: str
    cwd: Path
    commands: list[list[str]]
    env: dict[str, str]


@dataclasses.dataclass
class Ended:
    """How a suite ended: the exit code of its last command run (0: every one passed), its
    seconds, and its log file."""

    code: int
    seconds: float
    log: Path


def run_streams(streams: list[list[Suite]], log_dir: Path, say=print) -> dict[str, Ended]:
    """Run every stream at once, each stream's suites in order; when every stream is done,
    how each suite ended (suite name -> :class:`Ended`). ``say`` prints a suite's heading and
    log when it ends (one suite at a time)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    ended: dict[str, Ended] = {}
    printing = threading.Lock()

    def run(stream: list[Suite]) -> None:
        for suite in stream:
            ended[suite.name] = outcome = _run(suite, log_dir / f"{suite.name}.log")
            verdict = "passed" if outcome.code == 0 else f"FAILED (exit code {outcome.code})"
            with printing:
                say(f"===== {suite.name}: {verdict} in {outcome.seconds:.0f} s =====")
                say(outcome.log.read_text(errors="replace"))

    threads = [threading.Thread(target=run, args=(s,), name=s[0].name) for s in streams if s]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ended


def _run(suite: Suite, log: Path) -> Ended:
    start = time.monotonic()
    code = 0
    with open(log, "w") as out:
        for command in suite.commands:
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            code = subprocess.run(
                command, cwd=suite.cwd, env=suite.env, stdout=out, stderr=subprocess.STDOUT
            ).returncode
            if code:
                break
    return Ended(code, time.monotonic() - start, log)


def environment(changes: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with ``changes`` applied (``None``: unset)."""
    env = dict(os.environ)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env
