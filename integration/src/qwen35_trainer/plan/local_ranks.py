"""Run a function on ``ranks`` processes of this machine side by side, each in a process group
of them (gloo on the CPU; NCCL with one GPU each where CUDA is present), and collect what each
returns: how :mod:`.links` and :mod:`.layout_cost` measure ranks as a plan runs them.

The processes are spawned (a fresh interpreter each, as a launcher starts workers); one that
exits with an error, or a group not done within ``timeout`` seconds, is one ``RuntimeError``
naming it, and no process is left behind."""

from __future__ import annotations

import multiprocessing
import queue
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["run_on_local_ranks"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, ranks: int, port: int, fn: Callable, args: tuple, out) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", port, ranks, rank == 0)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=ranks)
    try:
        out.put((rank, fn(rank, ranks, device, *args)))
    finally:
        dist.destroy_process_group()


def run_on_local_ranks(ranks: int, fn: Callable, *args, what: str, timeout: float) -> dict:
    """``{rank: fn(rank, ranks, device, *args)}`` from ``ranks`` local processes (module
    docstring); ``what`` names the measurement in an error."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = _free_port()
    procs = [
        context.Process(target=_child, args=(r, ranks, port, fn, args, out)) for r in range(ranks)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + timeout
        while len(results) < ranks:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                code = procs[failed[0]].exitcode
                raise RuntimeError(f"{what} on {ranks} ranks: rank {failed[0]} exited with {code}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} on {ranks} ranks: not done in {timeout:g} s")
            try:
                rank, result = out.get(timeout=1.0)
            except queue.Empty:
                continue
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return results
