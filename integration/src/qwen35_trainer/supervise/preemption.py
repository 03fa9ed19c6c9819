"""Preemption: SIGTERM (what schedulers and container runtimes send before killing) and SIGUSR1
(Slurm's warning signal, ``#SBATCH --signal=USR1@300``) finish the current step, save a
checkpoint and stop (exit 5 from the CLI).

A signal may reach the ranks at different moments (or only some of them), so the decision is
agreed: after every step each rank contributes its flag to one all-reduce (MAX, a tensor on the
group's device) and all ranks stop after the SAME step, save together and raise
:class:`Preempted`; none is left waiting in a collective. The handlers are installed for the
duration of a run (main thread) and the previous ones restored.

A worker of a launch also catches them from its start (:func:`catch_stop_signals`): a signal
that arrives while the model is still being built is kept, and the run stops (saving) after its
first step, instead of the process dying unsaved. And it asks the kernel for SIGTERM when its
launcher dies (Linux ``PR_SET_PDEATHSIG``): a ``torchrun`` killed by a signal it does not
forward (SIGUSR1 without ``--signals-to-handle``) no longer leaves orphaned workers training to
the last step without saving; they stop and save as if the signal had reached them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator

import torch

from qwen35_trainer.parallel.dist import any_rank

__all__ = ["SIGNALS", "Preempted", "StopFlag", "catch_stop_signals"]

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


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
        self.requested = self.requested or _early.requested
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


_early = StopFlag()  # what a worker caught before its run's loop


def catch_stop_signals() -> None:
    """From a training process's start: keep a stop signal for the run; under an elastic agent
    (ours or ``torchrun``: ``TORCHELASTIC_RUN_ID`` set), get SIGTERM when the agent dies (module
    docstring; Linux only). A run started from a shell is not tied to the shell's life."""
    for s in SIGNALS:
        signal.signal(s, _early._handle)
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the launcher died before the request: as if it had just now
        _early.requested = True
