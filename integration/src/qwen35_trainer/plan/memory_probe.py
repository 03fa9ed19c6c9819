"""The memory one step of the trainer really takes on this rank, to check the planner's counted
tensors (:mod:`.memory`) and its allocator reserve (:mod:`.headroom`) against.

The step is the trainer's own (:func:`.step_probe.trainer_step`): run once so that the
optimizer's moments exist, its gradients dropped (as the trainer's ``zero_grad`` does), then
run again while the allocator is watched:

- on CUDA, torch's caching allocator reports its peaks itself: ``max_memory_allocated`` (what
  tensors held) and ``max_memory_reserved`` (what it took from the GPU);
- on a CPU, torch's allocator takes every tensor's memory from the C library's ``malloc``, so
  the bytes ``malloc`` has handed out and not taken back (glibc's ``mallinfo2``: its arenas'
  chunks in use and its mmapped blocks) rise and fall with the tensors. They are read after
  every aten op of the step (:class:`MallocPeak`, a dispatch mode, which sees the backward's
  ops too), when an op's outputs exist and its inputs are not yet freed: the peak at op
  granularity. A kernel's workspace that lives inside one op is not seen; the dispatch mode
  also makes the chunked loss run its eager kernels (a compiled region cannot run under it),
  which hold one chunk's logits as the planner's ``loss`` line assumes.

Either way the bytes held before the step that outlive it (:func:`persistent_bytes`: the
parameters, buffers and optimizer state, each storage once) are added to the rise above the
step's start, so that ``allocated`` is the step's peak of tensors, what :attr:`.memory.Memory.peak`
predicts for this rank.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwen35_trainer.plan.step_probe import process_group, trainer_step

__all__ = [
    "MallocPeak",
    "MemoryPeak",
    "malloc_in_use",
    "measure_peak",
    "persistent_bytes",
    "rank_peaks",
    "rank_peaks_each",
]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo2():
    try:
        info = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        raise RuntimeError(
            "measuring a CPU step's memory reads glibc's mallinfo2 (glibc 2.33 or newer, "
            "Linux); this C library has none"
        ) from None
    info.restype = _Mallinfo2
    return info


def malloc_in_use() -> int:
    """Bytes ``malloc`` has handed out and not taken back: its arenas' chunks in use plus its
    mmapped blocks (where large tensors live)."""
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


class MallocPeak(TorchDispatchMode):
    """The most :func:`malloc_in_use` read after any aten op run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self._read = _mallinfo2()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        info = self._read()
        self.peak = max(self.peak, info.uordblks + info.hblkhd)
        return out


@dataclasses.dataclass(frozen=True)
class MemoryPeak:
    """One step's bytes on one rank: ``allocated``, the peak of tensors; ``persistent``, of it,
    what the step started and ended with (parameters, buffers, optimizer state); ``reserved``,
    what the device's allocator held at its peak (CUDA only; ``None`` on a CPU, whose
    ``malloc`` keeps no cache a reserve could be read from)."""

    allocated: int
    persistent: int
    reserved: int | None

    @property
    def fragmentation(self) -> float | None:
        """The allocator's reserve over the tensors allocated and freed within the step, as
        :class:`.headroom.Headroom`'s ``fragmentation`` states it (CUDA only)."""
        transient = self.allocated - self.persistent
        if self.reserved is None or transient <= 0:
            return None
        return max(self.reserved - self.allocated, 0) / transient


def persistent_bytes(module: torch.nn.Module, optimizer) -> int:
    """Bytes of this rank's parameters, buffers and optimizer state (local shards), each
    storage counted once (:func:`.measured._storage`)."""
    from qwen35_trainer.plan.measured import _storage

    tensors = [*module.parameters(), *module.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    return sum(dict(_storage(t) for t in tensors if torch.is_tensor(t)).values())


def _watched(run, device: torch.device) -> tuple[int, int, int | None]:
    """``(start, peak, reserved)`` of ``run()``: the allocator's bytes in use before it, at its
    peak, and (CUDA) reserved at its peak."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # what earlier work left cached is not this step's reserve
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return (
            start,
            torch.cuda.max_memory_allocated(device),
            torch.cuda.max_memory_reserved(device),
        )
    start = malloc_in_use()
    mode = MallocPeak()
    with mode:
        run()
    return start, max(mode.peak, start), None


def measure_peak(recipe, device: torch.device, dims=None) -> MemoryPeak:
    """One step's :class:`MemoryPeak` of ``recipe`` on this rank (module docstring; ``dims``:
    its layout on the running process group, ``None``: one process)."""
    with process_group(device):
        step = trainer_step(recipe, device, dims)
        step.run()  # the optimizer's moments now exist, as in every later step
        for param in step.objective.parameters():
            param.grad = None
        gc.collect()
        persistent = persistent_bytes(step.objective, step.optimizer)
        start, peak, reserved = _watched(step.run, device)
    # reserved: the allocator's cache beyond the step's peak stays as it was
    held = None if reserved is None else persistent + reserved - start
    return MemoryPeak(persistent + peak - start, persistent, held)


def _rank_peaks(rank: int, ranks: int, device: torch.device, recipes) -> list[MemoryPeak]:
    from qwen35_trainer.parallel import validate_layout

    return [measure_peak(recipe, device, validate_layout(recipe, ranks)) for recipe in recipes]


def rank_peaks(recipe, ranks: int, timeout: float = 600) -> dict[int, MemoryPeak]:
    """Each rank's :class:`MemoryPeak` of ``recipe``'s layout run on ``ranks`` local processes
    side by side (:func:`.local_ranks.run_on_local_ranks`)."""
    return rank_peaks_each([recipe], ranks, timeout)[0]


def rank_peaks_each(recipes, ranks: int, timeout: float = 600) -> list[dict[int, MemoryPeak]]:
    """:func:`rank_peaks` of each of ``recipes`` (each laid out on ``ranks``), one after the
    other in one launch of the ranks."""
    from qwen35_trainer.plan.local_ranks import run_on_local_ranks

    per_rank = run_on_local_ranks(
        ranks, _rank_peaks, list(recipes), what="a step's memory", timeout=timeout
    )
    return [{rank: peaks[i] for rank, peaks in per_rank.items()} for i in range(len(recipes))]
