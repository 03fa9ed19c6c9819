"""Run a Python function on N ranks of a real gloo process group, from inside a test.

Each rank is a freshly *spawned* process (no fork: torch and gloo threads do not survive a
fork), so the function and its arguments must be picklable (a module-level function in the test
file is). The parent owns a ``TCPStore`` on a free port chosen by the OS, so there is no
port race between concurrent launches.

Every launch has a hard deadline: ``timeout`` seconds of running time, counted from the moment
the last rank has joined the process group (start-up — spawning, importing torch, the
rendezvous — has its own limit, ``STARTUP_TIMEOUT_S``, so a loaded machine does not eat a test's
running time). Ranks report over one pipe each; the parent waits on all of them at once, so it
notices immediately when a rank raises (its traceback comes back as text), when a rank dies
without reporting (``os._exit``, a segfault: its exit code is reported), and when a deadline
passes (every rank still running is killed and named). After the first
failure the others get a short grace period to finish or fail on their own before they are
killed: a rank that waits in a collective for a dead peer would otherwise hang until the
deadline.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["Outcome", "RankError", "launch", "report_progress", "run_ranks"]

DEFAULT_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 300.0
FAILURE_GRACE_S = 10.0


class RankError(AssertionError):
    """A multi-rank launch failed: a rank raised, crashed or hung. The message has the details."""


@dataclasses.dataclass
class Outcome:
    """One rank's report: ``ok`` with the returned ``value``, or the ``error`` text; plus every
    value the rank sent with :func:`report_progress` before it returned, failed or hung, and
    when each arrived (``progress_seconds``: seconds since every rank had joined the group)."""

    ok: bool
    value: Any = None
    error: str = ""
    progress: list[Any] = dataclasses.field(default_factory=list)
    progress_seconds: list[float] = dataclasses.field(default_factory=list)


_progress_conn: mpc.Connection | None = None


def report_progress(value: Any) -> None:
    """From inside a launched rank: send ``value`` to the parent right now.

    It reaches the parent even if the rank later hangs or crashes (see ``run_checks``).
    """
    if _progress_conn is None:
        raise RuntimeError("report_progress only works inside a rank started by run_ranks/launch")
    _progress_conn.send_bytes(pickle.dumps(("progress", value)))


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    conn: mpc.Connection,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    timeout_s: float,
    env: dict[str, str],
) -> None:
    global _progress_conn
    _progress_conn = conn
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        conn.send_bytes(pickle.dumps(("ready", None)))
        try:
            outcome = Outcome(True, fn(*args, **kwargs))
        finally:
            # Not a barrier: a failed rank must not wait for peers that are still computing.
            dist.destroy_process_group()
        payload = pickle.dumps(("done", outcome))
    except BaseException:
        payload = pickle.dumps(("done", Outcome(False, error=traceback.format_exc())))
    conn.send_bytes(payload)
    conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    Inside ``fn`` the default process group is initialised (``dist.get_rank()`` etc. work).
    Results travel back pickled, so return CPU tensors or plain data.

    Raises :class:`RankError` naming the failing ranks, with each failing rank's full
    traceback (or exit code), when any rank raises, exits without a result, or is still
    running after ``timeout`` seconds (then all ranks are killed).
    """
    outcomes = launch(fn, world_size, *args, timeout=timeout, env=env, **kwargs)
    failures = {r: o for r, o in enumerate(outcomes) if not o.ok}
    if failures:
        raise RankError(_format_failures(fn, world_size, failures))
    return [o.value for o in outcomes]


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Outcome]:
    """Like :func:`run_ranks`, but return every rank's :class:`Outcome` instead of raising."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_rank_main,
            args=(rank, world_size, store.port, child_conn, fn, args, kwargs, timeout, env or {}),
            name=f"rank{rank}",
            daemon=True,
        )
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    try:
        outcomes = _collect(procs, conns, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        del store
    return outcomes


def _collect(
    procs: Sequence[Any], conns: Sequence[mpc.Connection], timeout: float
) -> list[Outcome]:
    outcomes: list[Outcome | None] = [None] * len(procs)
    progress: list[list[Any]] = [[] for _ in procs]
    arrived: list[list[float]] = [[] for _ in procs]
    started = time.monotonic()
    deadline = started + STARTUP_TIMEOUT_S
    not_ready = set(range(len(procs)))
    waiting = dict(enumerate(conns))
    while waiting:
        now = time.monotonic()
        if now >= deadline:
            break
        ready = mpc.wait(list(waiting.values()), timeout=min(0.5, deadline - now))
        for rank, conn in list(waiting.items()):
            if conn not in ready:
                continue
            try:
                kind, value = pickle.loads(conn.recv_bytes())
                if kind == "ready":
                    not_ready.discard(rank)
                    if not not_ready:
                        started = time.monotonic()
                        deadline = started + timeout
                    continue
                if kind == "progress":
                    progress[rank].append(value)
                    arrived[rank].append(time.monotonic() - started)
                    continue
                outcomes[rank] = value
            except EOFError:
                procs[rank].join(5)
                outcomes[rank] = Outcome(
                    False,
                    error=f"rank {rank} exited with code {procs[rank].exitcode} without reporting a result",
                )
            del waiting[rank]
        if any(o is not None and not o.ok for o in outcomes):
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    for rank in waiting:
        if not_ready:
            why = f"ranks {sorted(not_ready)} had not joined the process group after {STARTUP_TIMEOUT_S:.0f} s"
        else:
            why = f"timeout {timeout:.0f} s after start-up, or a peer failed"
        outcomes[rank] = Outcome(
            False, error=f"rank {rank} hung: still running when the launch was killed ({why})"
        )
    done = [o for o in outcomes if o is not None]
    for outcome, sent, times in zip(done, progress, arrived, strict=True):
        outcome.progress = sent
        outcome.progress_seconds = times
    return done


def _format_failures(fn: Callable[..., Any], world_size: int, failures: dict[int, Outcome]) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    lines = [f"{name} failed on rank(s) {sorted(failures)} of world {world_size}"]
    for rank, outcome in sorted(failures.items()):
        lines.append(f"\n----- rank {rank} -----\n{outcome.error.rstrip()}")
    return "\n".join(lines)
