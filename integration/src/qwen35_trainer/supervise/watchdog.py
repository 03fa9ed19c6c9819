"""A hung rank found and named, instead of a job that waits until the scheduler's wall clock.

A rank that stops answering (a stopped or swapped-out process, a collective it never enters, a
dead link) leaves its peers waiting inside their next collective, which on NCCL or gloo can wait
for the group's timeout (NCCL's default: 10 minutes per collective, and the job's stays stuck as
long as it retries). Here every rank runs a :class:`Watchdog`: the run reports each phase it
enters (:meth:`Watchdog.beat`: the setup, each step's data / forward and backward / evaluation /
stop agreement / checkpoint, the export), and a rank that has reported nothing new for
``train.hang_timeout`` seconds (:data:`FIRST_STEP_FACTOR` times that until the first step
has finished: the setup, and a first step that compiles and warms up, take longer than the
steps after them) writes every thread's Python stack (``faulthandler``) to
``<output_dir>/hang/rank<r>.txt`` under a first line naming the rank, the step and the phase it
waits in, prints one line, and exits :data:`~qwen35_trainer.cli_common.EXIT_HUNG`. The live ranks
of a job with a hung rank all wait, so they all write their stacks: the rank that wrote none is
the one that stopped answering (the launcher names it, :mod:`qwen35_trainer.supervise.launch`).

Why a thread and a deadline rather than collective timeouts: a rank that waits in a collective
holds the GIL-free C++ call, so only another thread can report, and only the ranks' own clocks
are needed (no collective can be trusted while one rank is gone). The thread wakes every few
seconds, so the report comes at most that late; it never touches CUDA or a process group.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

from qwen35_trainer.cli_common import EXIT_HUNG

__all__ = ["FIRST_STEP_FACTOR", "HANG_FOLDER", "Watchdog"]

HANG_FOLDER = "hang"  # under the run folder: one rank<r>.txt per rank that reported
FIRST_STEP_FACTOR = 4  # the allowance before the first step has finished, in hang timeouts


class Watchdog:
    """One rank's watchdog (module docstring); ``timeout`` 0 watches nothing. A context
    manager: the thread runs inside the ``with`` block and is joined when it ends."""

    def __init__(self, timeout: float, folder: str | None, rank: int, world: int) -> None:
        self.timeout, self.rank, self.world = timeout, rank, world
        self.folder = Path(folder) / HANG_FOLDER if folder else None
        self.step, self.phase = 0, "setup (building and loading the model)"
        self.first: int | None = None  # the run's first step (resumed: a later one)
        self.warm = False  # whether that step has finished
        self.last = time.monotonic()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int, phase: str) -> None:
        """The run entered ``phase`` of step ``step`` (0: before its first step); the first
        step reported is the run's first, a later one means it has finished."""
        self.step, self.phase, self.last = step, phase, time.monotonic()
        if step and self.first is None:
            self.first = step
        self.warm = self.warm or (self.first is not None and step > self.first)

    def limit(self) -> float:
        """The seconds without progress that count as a hang now."""
        return self.timeout * (1 if self.warm else FIRST_STEP_FACTOR)

    def __enter__(self) -> Watchdog:
        if self.timeout > 0:
            self.last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="qwen35-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        poll = min(5.0, max(self.timeout / 4, 0.05))
        while not self._done.wait(poll):
            waited = time.monotonic() - self.last
            if waited > self.limit():
                self._report(waited)

    def _report(self, waited: float) -> None:
        """Write this rank's stacks, say so in one line, exit :data:`EXIT_HUNG`."""
        head = (
            f"rank {self.rank} of {self.world}: no progress for {waited:.0f} s "
            f"(limit {self.limit():g} s, train.hang_timeout={self.timeout:g}) at step "
            f"{self.step}, waiting in: {self.phase}"
        )
        where = "stderr"
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"rank{self.rank}.txt"
            with open(path, "w") as out:
                out.write(head + "\n\n")
                out.flush()
                faulthandler.dump_traceback(file=out, all_threads=True)
            where = str(path)
        else:
            print(head, file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(f"qwen35-train: {head}; stacks in {where}", file=sys.stderr, flush=True)
        os._exit(EXIT_HUNG)
