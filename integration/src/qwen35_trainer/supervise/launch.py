"""How a run's processes start and end: the built-in local launch (``nproc`` workers running
the same command under :class:`~qwen35_trainer.supervise.agent.SupervisingAgent`, which
forwards SIGTERM and SIGUSR1 and says every failure and restart aloud), the job's exit status,
a worker's exit, and the default run folder name (the same on every rank)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from qwen35_trainer.cli_common import EXIT_HUNG, EXIT_PREEMPTED
from qwen35_trainer.recipe import recipe_path
from qwen35_trainer.supervise.agent import SupervisingAgent, how_it_ended, say
from qwen35_trainer.supervise.hang_report import hang_report
from qwen35_trainer.supervise.run_folder import step_records

__all__ = ["STOP_SIGNALS", "Watched", "default_output_dir", "launch", "worker_exit"]

# what the agent forwards to the workers: torch's defaults and Slurm's warning signal
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")


def default_output_dir(recipe_arg: str) -> str:
    """``runs/<recipe>-<time>``; under a launcher the run id, the same on every rank."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    stamp = run_id if run_id and run_id != "none" else time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{recipe_path(recipe_arg).stem}-{stamp}")


@dataclasses.dataclass(frozen=True)
class Watched:
    """What the launcher reads of a run to report on it: its run folder (``None``: none), the
    step of its newest complete checkpoint (a function: ``None`` when there is none) and how
    long its workers get to save after a forwarded stop signal."""

    output_dir: str | None = None
    resume_step: Callable[[], int | None] = lambda: None
    stop_timeout: float = 600.0

    def last_step(self) -> int | None:
        """The run's last recorded step (``None`` before its first)."""
        path = Path(self.output_dir or "") / "metrics.jsonl"
        if self.output_dir is None or not path.is_file():
            return None
        steps = [r["step"] for r in step_records(path)]
        return max(steps) if steps else None


def launch(argv: list[str], nproc: int, max_restarts: int, watched: Watched | None = None) -> int:
    """Start ``nproc`` local workers running this command (they see ``WORLD_SIZE``) under the
    :class:`~qwen35_trainer.supervise.agent.SupervisingAgent`; the exit status of the job: 0,
    :data:`EXIT_PREEMPTED` after a forwarded stop signal, :data:`EXIT_HUNG` after a hang (the
    last line names the rank), else the first failed worker's (128 + N when signal N killed
    it, the shell's convention)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rendezvous

    watched = watched or Watched()
    # the workers and the agent below say why they stop; torch's process supervisor and agent
    # lines ("failed (exitcode: N)", "Sending process ... closing signal", "will restart worker
    # group") only repeat it
    for name in ("multiprocessing", "agent.server.api"):
        logging.getLogger(f"torch.distributed.elastic.{name}").setLevel(logging.CRITICAL)
    # like torchrun: the workers share the cores (unset, each would take all of them; 4 workers
    # x 2 threads on 2 cores wait on each other at every parallel region)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(STOP_SIGNALS)
    parameters = RendezvousParameters(
        backend="c10d",
        endpoint="localhost:0",
        run_id=uuid.uuid4().hex,
        min_nodes=1,
        max_nodes=1,
    )
    spec = WorkerSpec(
        role="trainer",
        local_world_size=nproc,
        entrypoint=sys.executable,
        args=("-m", "qwen35_trainer.cli", *argv),
        rdzv_handler=rendezvous.get_rendezvous_handler(parameters),
        max_restarts=max_restarts,
        monitor_interval=0.1,
    )
    agent = SupervisingAgent(
        spec=spec,
        logs_specs=DefaultLogsSpecs(),
        start_method="spawn",
        shutdown_timeout=math.ceil(watched.stop_timeout),
        last_step=watched.last_step,
        resume_step=watched.resume_step,
    )
    try:
        result = agent.run()
    except SignalException as stop:
        return _stopped(stop.sigval, agent.exit_codes, watched)
    finally:
        spec.rdzv_handler.shutdown()
    if not result.is_failed():
        return 0
    codes = {rank: failure.exitcode for rank, failure in result.failures.items()}
    if EXIT_HUNG in codes.values():
        say(hang_report(watched.output_dir, nproc))
        return EXIT_HUNG
    code = codes[min(codes)]
    return 128 - code if code < 0 else code


def _stopped(signum: signal.Signals, codes: dict[int, int | None], watched: Watched) -> int:
    """The job's end after the launcher forwarded a stop signal: said in one line; exit 5 (the
    run resumes from the newest complete checkpoint, whichever it is)."""
    late = {rank: code for rank, code in codes.items() if code != EXIT_PREEMPTED}
    name = signal.Signals(signum).name
    if not late:
        say(
            f"{name}: forwarded to the {len(codes)} workers; they finished the step, saved and stopped"
        )
    else:
        step = watched.resume_step()
        ends = "; ".join(f"rank {rank} {how_it_ended(code)}" for rank, code in sorted(late.items()))
        say(
            f"{name}: forwarded to the {len(codes)} workers; not all stopped after saving within "
            f"train.stop_timeout={watched.stop_timeout:g} s ({ends}); the newest complete "
            f"checkpoint is step {step}"
        )
    return EXIT_PREEMPTED


def worker_exit(code: int, *, agreed: bool) -> None:
    """End a worker without the interpreter's teardown. There, gloo's threads abort the process
    now and then ("terminate called without an active exception", exit 134): a finished run
    reads as failed, and the launcher then kills the ranks still writing their outputs (rank 0's
    ``loss.png``, rank 0's last message). After a successful or an agreed preempted run every
    rank waits for the others (they all ran the same collectives and stopped after the same
    step, so none waits forever: ``agreed``), the group is destroyed, and the process exits
    with ``code``."""
    if agreed:
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
