"""The process group of a run and the few collectives the trainer itself makes.

- :func:`init_distributed` creates the default group once: torchrun's (``WORLD_SIZE`` > 1;
  each elastic restart under its own store prefix), or a one-rank group for one process, kept
  for the life of the process (the trained model's DTensor parameters stay usable after the
  run; a later run reuses it). :func:`device` is this rank's device.
- :func:`rank`, :func:`world`: this process's place (0 of 1 without a group).
- :func:`any_rank`: whether ANY rank says so — the one agreement a check that can differ
  between ranks needs before anyone raises (a rank raising alone leaves its peers waiting in
  their next collective). One all-reduce (MAX) of a flag on the group's device: NCCL groups
  take CUDA tensors only.
- :func:`all_ranks`: every rank's Python value (``all_gather_object``; for the rare paths that
  need the reasons, not only the flag: checkpoint verdicts, the documents of a failed step).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_ranks", "any_rank", "device", "init_distributed", "rank", "world"]


def device() -> torch.device:
    """This rank's device: its local CUDA device (made current), else the CPU."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed() -> None:
    """Create the default process group unless it exists (see the module docstring)."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None:
            dist.init_process_group(backend)
            return
        # Restarted workers share the elastic agent's store with the attempt before them, whose
        # keys (a rank's address, under the same group names) are still there: each attempt
        # gets its own key prefix, so no worker reads a dead worker's address.
        store, rank_, world_ = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"qwen35_trainer/attempt_{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank_, world_size=world_)
        return
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def any_rank(flag: bool, on: torch.device | None = None) -> bool:
    """Whether any rank of the default group passed ``True`` (every rank gets the same
    answer); ``on``: the group's device (default: :func:`device`)."""
    if world() == 1:
        return flag
    value = torch.tensor([int(flag)], device=on if on is not None else device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def all_ranks(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (one ``all_gather_object``)."""
    if world() == 1:
        return [value]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, value)
    return out
