"""The local link, measured: ``ranks`` processes started side by side on this machine (gloo on
CPU tensors; NCCL on one GPU each where CUDA is present) all-reduce a one-element tensor (the
latency) and a message of the plan's size (its largest kind's bytes per FSDP unit, between
4 MiB, below which the CPU's scheduling noise swamps a gloo transfer, and 64 MiB), each the median of 20 rounds after a warm-up, each round started by a
barrier; the rank that leaves the barrier last waits for no one, so the smallest median is the
collective's own time (:func:`.local_ranks.run_on_local_ranks` starts the ranks).

A ring all-reduce over ``n`` ranks sends ``2 (n − 1) / n`` of the message from every rank, so
the bandwidth is those bytes over the message's time less the latency: the "bytes a rank sends
per second" that :mod:`.traffic`'s per-rank bytes divide by.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from qwen35_trainer.plan.local_ranks import run_on_local_ranks

__all__ = ["measure_link", "message_bytes"]

ROUNDS = 20
SMALLEST, LARGEST = 4 << 20, 64 << 20
TIMEOUT_S = 120


def message_bytes(plan) -> int:
    """The measured message (module docstring)."""
    units = max((w.units for w in plan.work.values()), default=1)
    largest = max((n for t in plan.rank_traffic.values() for n in t.values()), default=0)
    return int(min(max(largest // max(units, 1), SMALLEST), LARGEST))


def _link_times(rank: int, ranks: int, device: torch.device, size: int) -> dict[str, float]:
    """This rank's median seconds of a one-element and a ``size``-byte all-reduce."""
    times = {}
    for name, numel in (("latency", 1), ("message", size // 4)):
        data = torch.ones(numel, device=device)
        dist.all_reduce(data)  # warm-up
        seconds = []
        for _ in range(ROUNDS):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(data)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        times[name] = statistics.median(seconds)
    return times


def measure_link(ranks: int, plan) -> dict[str, float]:
    """``{"bytes_per_s", "latency_s", "ranks", "message_bytes"}`` among ``ranks`` local
    processes (module docstring)."""
    size = message_bytes(plan)
    results = run_on_local_ranks(
        ranks, _link_times, size, what="measuring the local link", timeout=TIMEOUT_S
    )
    # the rank that left the barrier last waited for no one: its times are the collective's
    latency = min(t["latency"] for t in results.values())
    message = min(t["message"] for t in results.values())
    sent = 2 * (ranks - 1) / ranks * (size // 4) * 4
    return {
        "bytes_per_s": sent / max(message - latency, message / 10),
        "latency_s": latency,
        "ranks": ranks,
        "message_bytes": size,
    }
