"""Preemption and worker failure, on real processes: SIGTERM to ONE of 2 workers stops both
after the same step with a checkpoint and exit code 5, and the run resumes from it; a worker
killed with SIGKILL under ``--max-restarts 1`` brings both back from the newest checkpoint and
the run ends with the uninterrupted run's losses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwen35_trainer.supervise.run_folder import step_records

BASE = [
    "tiny",
    "--nproc",
    "2",
    "--set",
    "parallel.cp=1",
    "--set",
    "parallel.ep=1",
    "--set",
    "data.samples_per_rank=2",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# the most one phase of a test may take (a start, a stop, a resumed run), so that a hang fails;
# in CI these runs share two cores with a 4-rank launch of another file (a whole test took 293 s)
PHASE_S = 420


@pytest.fixture
def start():
    """``start(out, *extra)`` starts a 2-worker CLI run writing to ``out``. A run still going when
    the test ends (it failed midway) is stopped then: SIGTERM to its launcher, whose elastic
    agent stops the workers (each in its own session), so a failure does not leave a 200-step
    run taking the cores from the rest of the suite."""
    started: list[subprocess.Popen] = []

    def _start(out: Path, *extra: str) -> subprocess.Popen:
        cmd = [
            sys.executable,
            "-m",
            "qwen35_trainer.cli",
            *BASE,
            "--set",
            f"train.output_dir={out}",
            *extra,
        ]
        started.append(
            subprocess.Popen(
                cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
        return started[-1]

    yield _start
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def _steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    # step records only (a run's header record is not a step); a line being written may be cut
    return sum(line.startswith('{"step"') for line in path.read_text().splitlines())


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = PHASE_S) -> None:
    deadline = time.monotonic() + timeout
    while _steps_done(out) < step:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not get that far"
        time.sleep(0.2)


def _worker(launcher: int, rank: int) -> int:
    """The pid of the launcher's worker process with ``RANK=rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise AssertionError(f"no worker of rank {rank} under {launcher}")


def _losses(out: Path) -> dict[int, float]:
    """The last record of every step (a restarted run repeats the steps after its checkpoint)."""
    records = step_records(out / "metrics.jsonl")
    return {r["step"]: r["loss"] for r in records}


def test_sigterm_to_one_worker_stops_both_with_a_checkpoint_then_resumes(start, tmp_path):
    out = tmp_path / "run"
    proc = start(out, "--set", "train.steps=200", "--set", "train.checkpoint_every=1000")
    _wait_for_step(out, 2, proc)
    os.kill(_worker(proc.pid, 1), signal.SIGTERM)
    _, stderr = proc.communicate(timeout=PHASE_S)
    assert proc.returncode == 5, stderr[-3000:]
    assert "stopped on a signal after step" in stderr
    assert "failed (exitcode" not in stderr and "closing signal" not in stderr  # supervisor quiet
    step = max(_losses(out))
    assert (out / "checkpoints" / f"step_{step:06d}" / ".metadata").is_file()
    again = start(out, "--set", f"train.steps={step + 1}", "--set", "train.checkpoint_every=1000")
    _, stderr = again.communicate(timeout=PHASE_S)
    assert again.returncode == 0, stderr[-3000:]
    assert f"resumed from step {step}" in stderr
    assert max(_losses(out)) == step + 1


def test_a_killed_worker_is_replaced_and_the_run_ends_as_if_nothing_happened(start, tmp_path):
    steps = ["--set", "train.steps=8", "--set", "train.checkpoint_every=2"]
    straight = start(tmp_path / "straight", *steps)
    _, stderr = straight.communicate(timeout=PHASE_S)
    assert straight.returncode == 0, stderr[-3000:]
    out = tmp_path / "killed"
    proc = start(out, *steps, "--max-restarts", "1")
    _wait_for_step(out, 3, proc)
    os.kill(_worker(proc.pid, 1), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=PHASE_S)
    assert proc.returncode == 0, stderr[-3000:]
    assert "resumed from step" in stderr  # it really restarted
    assert _losses(out) == _losses(tmp_path / "straight")
