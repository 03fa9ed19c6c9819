"""The local link, measured: ``ranks`` processes started side by side on this machine (gloo on
CPU tensors; NCCL on one GPU each where CUDA is present) all-reduce a one-element tensor (the
latency) and a message of the plan's size (its largest kind's bytes per FSDP unit, between
256 KiB and 64 MiB), each the median of a few rounds after a warm-up.

A ring all-reduce over ``n`` ranks sends ``2 (n − 1) / n`` of the message from every rank, so
the bandwidth is those bytes over the message's time less the latency: the "bytes a rank sends
per second" that :mod:`.traffic`'s per-rank bytes divide by.
"""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["measure_link", "message_bytes"]

ROUNDS = 5
SMALLEST, LARGEST = 256 << 10, 64 << 20
TIMEOUT_S = 120


def message_bytes(plan) -> int:
    """The measured message (module docstring)."""
    units = max((w.units for w in plan.work.values()), default=1)
    largest = max((n for t in plan.rank_traffic.values() for n in t.values()), default=0)
    return int(min(max(largest // max(units, 1), SMALLEST), LARGEST))


def _rank(rank: int, ranks: int, port: int, size: int, out) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", port, ranks, rank == 0)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=ranks)
    try:
        times = {}
        for name, numel in (("latency", 1), ("message", size // 4)):
            data = torch.ones(numel, device=device)
            dist.all_reduce(data)  # warm-up
            seconds = []
            for _ in range(ROUNDS):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                dist.all_reduce(data)
                if cuda:
                    torch.cuda.synchronize(device)
                seconds.append(time.perf_counter() - start)
            times[name] = statistics.median(seconds)
        out.put((rank, times))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_link(ranks: int, plan) -> dict[str, float]:
    """``{"bytes_per_s", "latency_s", "ranks"}`` among ``ranks`` local processes (module
    docstring); ``RuntimeError`` naming a rank that failed or did not finish in time."""
    size = message_bytes(plan)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_rank, args=(r, ranks, port, size, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(results) < ranks:
            left = deadline - time.monotonic()
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed or left <= 0:
                why = (
                    f"rank {failed[0]} exited with {procs[failed[0]].exitcode}"
                    if failed
                    else (f"not done in {TIMEOUT_S} s")
                )
                raise RuntimeError(f"measuring the local link among {ranks} processes: {why}")
            try:
                rank, times = out.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty: look at the processes again
                continue
            results[rank] = times
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    latency = max(t["latency"] for t in results.values())
    message = max(t["message"] for t in results.values())
    sent = 2 * (ranks - 1) / ranks * (size // 4) * 4
    return {
        "bytes_per_s": sent / max(message - latency, message / 10),
        "latency_s": latency,
        "ranks": ranks,
        "message_bytes": size,
    }
