"""Checks that all ranks of a group agree on before anyone raises, on the group's device.

A rank that raises on bad input while its peers enter the next collective leaves them hanging
until the process-group timeout. Every rank therefore reports its local verdict through one tiny
all-reduce; if any rank found a problem, every rank raises — the ones that found nothing say
which ranks did. The flag tensor lives on the group's device: NCCL groups take CUDA tensors
only, gloo takes CPU tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["agreed_errors", "group_device", "raise_if_bad"]

# Backends that run collectives on CPU tensors.
_CPU_BACKENDS = ("gloo", "mpi", "fake")


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device a collective on ``group`` needs its tensors on.

    A backend string such as ``"cpu:gloo,cuda:nccl"`` serves CPU tensors, so CPU wins whenever
    the group has a CPU backend; an NCCL-only group needs the current CUDA device.
    """
    backend = str(dist.get_backend(group)).lower()
    if "cpu:" in backend or any(name in backend for name in _CPU_BACKENDS):
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise ValueError(f"process-group backend {backend!r} has no CPU support and no accelerator")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def agreed_errors(
    error: str | None, group: dist.ProcessGroup, extra: list[int] | None = None
) -> tuple[list[int], list[int]]:
    """One all-reduce (MAX) of every rank's error flag plus ``extra`` int64 values.

    Returns (ranks that reported an error, the MAX of each ``extra`` value over the group).
    """
    world = dist.get_world_size(group)
    values = torch.zeros(world + len(extra or []), dtype=torch.int64)
    values[dist.get_rank(group)] = int(error is not None)
    if extra:
        values[world:] = torch.tensor(extra, dtype=torch.int64)
    values = values.to(group_device(group))
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    values = values.cpu()
    return [r for r in range(world) if values[r]], values[world:].tolist()


def raise_if_bad(error: str | None, bad: list[int]) -> None:
    """Raise on every rank when ``bad`` (the ranks that reported an error) is not empty."""
    if not bad:
        return
    if error is not None:
        raise ValueError(error)
    raise ValueError(
        f"invalid input on rank(s) {bad} of the group (see their error); raising here too so no rank hangs"
    )
