"""The run as a cluster runs it, through the real CLI on 2 gloo workers of the tiny recipe:

- a stop signal (SIGTERM, SIGUSR1) delivered to the built-in launcher alone, to every process of
  the job at once (as ``srun`` / Slurm does), to ``torchrun`` as ``docs/scaling.md`` starts it
  (``--signals-to-handle`` with SIGUSR1) and to a ``torchrun`` that does not forward it (it dies;
  its workers get SIGTERM from the kernel), or to ONE worker: the workers finish the step, save
  one checkpoint that verifies, and stop; our launcher exits 5 with one line, no traceback, and
  no process is left;
- a worker stopped with SIGSTOP: after ``train.hang_timeout`` the live rank writes its stacks
  naming its step and what it waits in, the job exits 6 and the launcher's last line names the
  stopped rank; nothing is left running;
- a worker killed with SIGKILL under ``--max-restarts 1``: the launcher says which rank died how
  and after which step, then "restart 1 of 1 ... from step s"; the run ends with the
  uninterrupted run's losses, one record per step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwen35_trainer.supervise.agent import FAILED_STOP_S
from qwen35_trainer.supervise.run_folder import step_records
from qwen35_trainer.train.integrity import INTACT, verify_all

BASE = [
    "tiny",
    "--set",
    "parallel.cp=1",
    "--set",
    "parallel.ep=1",
    "--set",
    "data.samples_per_rank=2",
]
LONG = ["--set", "train.steps=200", "--set", "train.checkpoint_every=1000"]
# TORCH_COMPILE_DISABLE: the loss's per-chunk kernels run eagerly (exact, chunked-loss's own
# fallback); compiling them costs each worker 3 s (12 s on a cold Inductor cache) and these runs
# are about processes, not kernels (the CLI's compiled loss: test_cli.py, test_train_compiled.py)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"}
# the most one phase of a test may take (a start, a stop, a resumed run), so that a hang fails;
# in CI these runs share two cores with a 4-rank launch of another file (a whole test took 293 s)
PHASE_S = 420
# what docs/scaling.md's sbatch example gives torchrun (checked below): SIGUSR1 forwarded, time
# to save
TORCHRUN = [
    "-m",
    "torch.distributed.run",
    "--nproc-per-node",
    "2",
    "--signals-to-handle",
    "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    "--shutdown-timeout",
    "600",
]


@pytest.fixture
def start():
    """``start(out, *extra, launcher=...)`` starts a 2-worker run writing to ``out``: the
    built-in launcher (``--nproc 2``), or ``torchrun`` with ``launcher`` its arguments. A run
    still going when the test ends (it failed midway) is killed with its workers then, so a
    failure does not leave a 200-step run taking the cores from the rest of the suite."""
    started: list[subprocess.Popen] = []

    def _start(out: Path, *extra: str, launcher: list[str] | None = None) -> subprocess.Popen:
        head = ["-m", "qwen35_trainer.cli", *BASE[:1], "--nproc", "2"]
        if launcher is not None:
            head = [*launcher, "-m", "qwen35_trainer.cli", *BASE[:1]]
        cmd = [sys.executable, *head, *BASE[1:], "--set", f"train.output_dir={out}", *extra]
        started.append(
            subprocess.Popen(
                cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
        return started[-1]

    yield _start
    for proc in started:
        for pid in _workers(proc.pid):  # first: they hold the launcher's output pipes open
            _kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


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


def _workers(launcher: int) -> list[int]:
    """The pids of the launcher's worker processes (RANK set in their environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if ppid == launcher and any(v.startswith(b"RANK=") for v in env):
            found.append(int(entry.name))
    return sorted(found, key=lambda pid: _rank_of(pid))


def _rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"RANK="))[5:])


def _gone(pids: list[int], timeout: float = 30) -> bool:
    """Whether every process of ``pids`` has ended (or become a zombie) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in step_records(out / "metrics.jsonl")}


def _saved_and_intact(out: Path) -> int:
    """The one checkpoint the stop saved, verified against its manifest; its step."""
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert len(saved) == 1, saved
    (verdict,) = verify_all(saved[0])
    assert verdict.state == INTACT, verdict.describe()
    return int(saved[0].name.split("_")[1])


def _stopped_cleanly(proc: subprocess.Popen, workers: list[int], out: Path) -> str:
    _, stderr = proc.communicate(timeout=PHASE_S)
    assert proc.returncode == 5, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "stopped on a signal after step" in stderr
    assert _gone(workers), "a worker outlived the launcher"
    _saved_and_intact(out)
    return stderr


def test_the_sbatch_example_gives_torchrun_what_these_tests_give_it():
    sbatch = (Path(__file__).parents[1] / "docs" / "scaling.md").read_text()
    assert " ".join(TORCHRUN[4:]) in sbatch


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_stop_signal_to_the_launcher_alone(start, tmp_path, signum):
    """``kill -USR1 <launcher>`` (Slurm's ``--signal=B:USR1``) and ``kill -TERM <launcher>`` (a
    container runtime): forwarded, saved, exit 5. The USR1 run then resumes from its checkpoint
    (that a resumed run takes the uninterrupted run's steps: test_train_dp.py's resume checks)."""
    out = tmp_path / "run"
    proc = start(out, *LONG)
    _wait_for_step(out, 2, proc)
    workers = _workers(proc.pid)
    os.kill(proc.pid, signum)
    stderr = _stopped_cleanly(proc, workers, out)
    assert (
        stderr.rstrip()
        .splitlines()[-1]
        .startswith(f"qwen35-train: {signal.Signals(signum).name}: forwarded to the 2 workers")
    )
    if signum == signal.SIGUSR1:
        step = _saved_and_intact(out)
        again = start(
            out, "--set", f"train.steps={step + 1}", "--set", "train.checkpoint_every=1000"
        )
        _, stderr = again.communicate(timeout=PHASE_S)
        assert again.returncode == 0, stderr[-3000:]
        assert f"resumed from step {step}" in stderr
        assert max(_losses(out)) == step + 1


def test_stop_signal_to_every_process_at_once(start, tmp_path):
    """Slurm signals every process of the job step: launcher and workers get SIGUSR1 together."""
    out = tmp_path / "run"
    proc = start(out, *LONG)
    _wait_for_step(out, 2, proc)
    workers = _workers(proc.pid)
    for pid in [proc.pid, *workers]:
        os.kill(pid, signal.SIGUSR1)
    _stopped_cleanly(proc, workers, out)


def test_stop_signal_to_one_worker(start, tmp_path):
    """SIGTERM to ONE of the 2 workers: both stop after the same step (agreed), exit 5."""
    out = tmp_path / "run"
    proc = start(out, *LONG)
    _wait_for_step(out, 2, proc)
    workers = _workers(proc.pid)
    os.kill(workers[1], signal.SIGTERM)
    stderr = _stopped_cleanly(proc, workers, out)
    assert "failed (exitcode" not in stderr and "closing signal" not in stderr  # quiet supervisor


@pytest.mark.parametrize("forwarded", [True, False], ids=["signals_to_handle", "plain"])
def test_sigusr1_to_torchrun(start, tmp_path, forwarded):
    """``torchrun`` as docs/scaling.md starts it forwards SIGUSR1: the workers save and stop.
    A plain ``torchrun`` dies of it (SIGUSR1's default action); its workers, told by the kernel
    (SIGTERM on their parent's death), save and stop all the same instead of training on."""
    out = tmp_path / "run"
    launcher = TORCHRUN if forwarded else TORCHRUN[:4]
    proc = start(out, *LONG, launcher=launcher)
    _wait_for_step(out, 2, proc)
    workers = _workers(proc.pid)
    os.kill(proc.pid, signal.SIGUSR1)
    proc.communicate(timeout=PHASE_S)
    assert _gone(workers, timeout=PHASE_S), "a worker is still running"
    _saved_and_intact(out)
    assert "stopped on a signal after step" in (out / "logs" / "rank0.log").read_text()


def test_a_stopped_worker_is_found_and_named(start, tmp_path):
    """SIGSTOP to rank 1: rank 0 waits in the step's collectives; after train.hang_timeout it
    writes its stacks and the job exits 6, the launcher's last line naming rank 1, at once: the
    stopped worker is killed, not given the survivors' FAILED_STOP_S to act on a SIGTERM it
    cannot see. (20 s: the steps before, 4 times that for the first, must not pass it on a
    loaded CI machine.)"""
    out = tmp_path / "run"
    proc = start(out, *LONG, "--set", "train.hang_timeout=20")
    _wait_for_step(out, 2, proc)
    workers = _workers(proc.pid)
    os.kill(workers[1], signal.SIGSTOP)
    _, stderr = proc.communicate(timeout=PHASE_S)
    ended = time.time()
    assert proc.returncode == 6, stderr[-3000:]
    last = stderr.rstrip().splitlines()[-1]
    assert last.startswith("qwen35-train: rank 1 stopped answering"), last
    reported = (out / "hang" / "rank0.txt").stat().st_mtime
    assert ended - reported < FAILED_STOP_S / 2, "the stopped worker was waited for, not killed"
    stacks = (out / "hang" / "rank0.txt").read_text()
    assert stacks.startswith("rank 0 of 2: no progress for "), stacks[:300]
    assert "waiting in: " in stacks.splitlines()[0] and "File " in stacks
    assert not (out / "hang" / "rank1.txt").exists()
    assert _gone(workers), "the stopped worker was left behind"


def test_a_killed_worker_is_replaced_said_aloud_and_the_run_ends_as_if_nothing_happened(
    start, tmp_path
):
    steps = ["--set", "train.steps=8", "--set", "train.checkpoint_every=2"]
    straight = start(tmp_path / "straight", *steps)
    _, stderr = straight.communicate(timeout=PHASE_S)
    assert straight.returncode == 0, stderr[-3000:]
    out = tmp_path / "killed"
    proc = start(out, *steps, "--max-restarts", "1")
    _wait_for_step(out, 3, proc)
    os.kill(_workers(proc.pid)[1], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=PHASE_S)
    assert proc.returncode == 0, stderr[-3000:]
    assert "qwen35-train: worker rank 1 was killed by signal 9 (SIGKILL) after step " in stderr
    assert "qwen35-train: restart 1 of 1: every worker starts again from step " in stderr
    assert "resumed from step" in stderr  # it really restarted
    records = step_records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))  # each step once
    assert _losses(out) == _losses(tmp_path / "straight")
