"""The built-in launcher's agent: PyTorch's local elastic agent, which starts the workers,
watches them and restarts them all after a failure (``--max-restarts``), plus what a team needs
to see and a scheduler needs to get:

- every failure said aloud, one line per worker: which rank ended how (exit code, or the signal
  that killed it) after which step (the run folder's last recorded step), and before a restart
  "restart k of n from step s" (the newest complete checkpoint, which the workers resume from);
- a failure that is a stop (every failed worker exited 5: they saved after a stop signal) or a
  bad recipe (exit 2) is not restarted: the same error would come back;
- a stop signal the launcher receives (SIGTERM, SIGUSR1: torch's agent raises on the signals it
  is told to handle, ``TORCHELASTIC_SIGNALS_TO_HANDLE``) is forwarded to the workers, which get
  ``train.stop_timeout`` seconds to finish their step and save before they are killed; the
  workers of a failed group have nothing to save and get :data:`FAILED_STOP_S`. Further stop
  signals during that wait are ignored (Slurm signals every process of a step: the launcher may
  get its own copy while the workers already save). A stopped worker (SIGSTOP) acts on no
  signal but SIGKILL, so it gets that at once instead of after the whole allowance.

It overrides only the agent's documented extension points (``_monitor_workers``,
``_stop_workers``, ``_shutdown``, ``_restart_workers``) and reads each worker's exit status from
the process context it closed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from qwen35_trainer.cli_common import EXIT_BAD_RECIPE, EXIT_PREEMPTED

__all__ = ["FAILED_STOP_S", "SupervisingAgent", "how_it_ended"]

FAILED_STOP_S = 30  # seconds the survivors of a failed group get before SIGKILL
NOT_RESTARTED = (EXIT_PREEMPTED, EXIT_BAD_RECIPE)


def how_it_ended(code: int | None) -> str:
    """A worker's end in words: its exit code, or the signal that killed it."""
    if code is None:
        return "was still running"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else "?"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def say(message: str) -> None:
    print(f"qwen35-train: {message}", file=sys.stderr, flush=True)


class SupervisingAgent(LocalElasticAgent):
    """:class:`LocalElasticAgent` with the module docstring's reports and stop policy.
    ``last_step()``: the run's last recorded step (``None`` before the first); ``resume_step()``:
    the step of the newest complete checkpoint (``None``: none yet)."""

    def __init__(
        self,
        *args,
        last_step: Callable[[], int | None],
        resume_step: Callable[[], int | None],
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.last_step, self.resume_step = last_step, resume_step
        self.exit_codes: dict[int, int | None] = {}  # local rank -> code, after a shutdown

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        # the parent's poll closes the group (SIGTERM, then SIGKILL after 30 s) once a worker
        # failed; a stopped survivor would act on the SIGTERM only at its SIGKILL
        handlers = self._handlers()
        if any(h.proc.poll() not in (None, 0) for h in handlers):
            _kill_stopped(handlers)
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
            step = self.last_step()
            after = f"after step {step}" if step else "before its first step"
            for rank, failure in sorted(result.failures.items()):
                say(f"worker rank {rank} {how_it_ended(failure.exitcode)} {after}")
            if all(f.exitcode in NOT_RESTARTED for f in result.failures.values()):
                self._remaining_restarts = 0  # a stop or a bad recipe: not worth a restart
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        spec = worker_group.spec
        attempt = spec.max_restarts - self._remaining_restarts
        step = self.resume_step()
        start = f"from step {step} (the newest complete checkpoint)" if step else "from step 0"
        say(f"restart {attempt} of {spec.max_restarts}: every worker starts again {start}")
        super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown(timeout=FAILED_STOP_S)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        handlers = self._handlers()
        alive = any(h.proc.poll() is None for h in handlers)
        stop = death_sig in (signal.SIGTERM, signal.SIGUSR1) and timeout == self._shutdown_timeout
        if alive and stop:
            for s in (signal.SIGTERM, signal.SIGUSR1):  # the workers save meanwhile
                signal.signal(s, signal.SIG_IGN)
        _kill_stopped(handlers)
        super()._shutdown(death_sig, timeout)
        self.exit_codes = {rank: h.proc.poll() for rank, h in enumerate(handlers)}

    def _handlers(self) -> list:
        """The workers' process handlers, by local rank (none before the first start)."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        return [handlers[rank] for rank in sorted(handlers)]


def _kill_stopped(handlers: list) -> None:
    """SIGKILL to the process group of every stopped worker (SIGSTOP, ^Z; Linux's process state
    ``T``): it acts on no other signal while stopped, and continuing it instead would let its
    own watchdog report the time it spent stopped as a hang of its peers."""
    for handler in handlers:
        if handler.proc.poll() is None and _is_stopped(handler.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(handler.proc.pid, signal.SIGKILL)


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (``False`` where ``/proc`` is absent)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False
