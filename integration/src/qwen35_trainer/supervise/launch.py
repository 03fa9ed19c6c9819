"""How a run's processes start and end: the built-in local launch (PyTorch's elastic launcher,
``nproc`` workers running the same command), a worker's exit, and the default run folder name
(the same on every rank)."""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid

import torch.distributed as dist

from qwen35_trainer.recipe import recipe_path

__all__ = ["default_output_dir", "launch", "worker_exit"]


def default_output_dir(recipe_arg: str) -> str:
    """``runs/<recipe>-<time>``; under a launcher the run id, the same on every rank."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    stamp = run_id if run_id and run_id != "none" else time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{recipe_path(recipe_arg).stem}-{stamp}")


def launch(argv: list[str], nproc: int, max_restarts: int) -> int:
    """Start ``nproc`` local workers running this command (they see ``WORLD_SIZE``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the workers say why they stop (rank 0's message); the process supervisor's own lines
    # ("failed (exitcode: N)", "Sending process ... closing signal") only repeat it. Restart
    # notices come from the agent's logger and stay.
    logging.getLogger("torch.distributed.elastic.multiprocessing").setLevel(logging.CRITICAL)
    # like torchrun: the workers share the cores (unset, each would take all of them; 4 workers
    # x 2 threads on 2 cores wait on each other at every parallel region)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "qwen35_trainer.cli", *argv)
    except ChildFailedError as failed:  # the first worker to fail says why (others follow)
        rank, failure = failed.get_first_failure()
        if failure.exitcode < 0:  # killed by a signal: nobody else says so
            print(
                f"qwen35-train: worker rank {rank} was killed by signal {-failure.exitcode}",
                file=sys.stderr,
                flush=True,
            )
            return 128 - failure.exitcode  # the shell's convention
        return failure.exitcode
    return 0


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
