"""Preemption: SIGTERM (what schedulers send before killing) and SIGUSR1 (Slurm's warning
signal, ``#SBATCH --signal=USR1@120``) finish the current step, save a checkpoint and stop.

A signal may reach the ranks at different moments (or only some of them), so the decision is
agreed: after every step each rank contributes its flag to one all-reduce (MAX, a tensor on the
group's device) and all ranks stop after the SAME step, save together and raise
:class:`Preempted`; none is left waiting in a collective. The handlers are installed for the
duration of a run only (main thread) and the previous ones restored.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import torch

from qwen35_trainer.parallel.dist import any_rank

__all__ = ["SIGNALS", "Preempted", "StopFlag"]

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped after ``step`` finished steps on a signal; ``checkpoint``: where that
    state was saved (``None`` when the recipe has no checkpoint directory)."""

    def __init__(self, step: int, checkpoint) -> None:
        super().__init__(f"stopped on a signal after step {step}; saved: {checkpoint}")
        self.step, self.checkpoint = step, checkpoint


class StopFlag:
    """Set by the signal handlers; :meth:`agreed` is the decision of all ranks."""

    def __init__(self) -> None:
        self.requested = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopFlag]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Whether ANY rank was asked to stop (one all-reduce under a process group)."""
        return any_rank(self.requested, device)
