"""``prewarm``: run the cuBLAS, communicator and fla prewarms, each isolated, and report.

Guarantees:
- RNG: the CPU generator and the target CUDA device's generator are forked around all steps
  (``torch.random.fork_rng``), so their state after ``prewarm`` equals the state before, also
  when a step fails. Only the target device's CUDA generator is saved: saving every device's
  would create a CUDA context (hundreds of MiB) on GPUs this rank never uses.
- Isolation: each step runs under its own ``try``; an exception becomes a ``failed`` step with
  its error and traceback, and the next step still runs. Argument errors (wrong types, non-float
  dtypes) raise ``TypeError``/``ValueError`` before any step, identically on every rank.
- Memory: on CUDA, the device is synchronised after each step, and the bytes used on the device
  outside the caching allocator are recorded before and after it.

Multi-rank: every rank must call ``prewarm`` with the same flags and an identically structured
model, since the communicator step runs collectives. A rank whose communicator step fails still
attempts every later group (see :mod:`setup_prewarm.comm`); a rank that dies leaves its peers
waiting until the process group's timeout.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from setup_prewarm.comm import collect_groups, warm_groups
from setup_prewarm.cublas import warm_cublas
from setup_prewarm.fla_warm import warm_fla
from setup_prewarm.report import PrewarmReport, SkipStep, StepReport

__all__ = ["prewarm"]


def prewarm(
    model: nn.Module | None = None,
    *,
    device: torch.device | str | int | None = None,
    cublas: bool = True,
    comm_groups: bool = True,
    fla: bool = True,
    dtypes: Iterable[torch.dtype] = (torch.float32, torch.bfloat16),
    groups: Iterable[dist.ProcessGroup | DeviceMesh] = (),
) -> PrewarmReport:
    """Prewarm what a first training step would otherwise initialise lazily; never raises
    once the arguments are valid.

    Args:
        model: scanned for DTensor parameters (communicator step) and gated-delta-rule layers
            (fla step); ``None`` skips the fla step and leaves only ``groups`` for the
            communicator step.
        device: the CUDA device to warm; default the current CUDA device, or CPU without CUDA
            (then the cuBLAS and fla steps are skipped with a reason).
        cublas / comm_groups / fla: run that step (a disabled step is reported as skipped).
        dtypes: floating dtypes for the cuBLAS matmuls.
        groups: extra ``ProcessGroup`` objects and/or ``DeviceMesh`` objects (all dims) to
            all-reduce on, de-duplicated with the model's.

    Returns:
        A :class:`PrewarmReport` with the steps ``cublas``, ``comm_groups`` and ``fla``.
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    target = _resolve_device(device)
    dtypes = _check_dtypes(dtypes)
    groups = _check_groups(groups)

    def comm_step() -> str:
        targets = collect_groups(model, groups)
        if not targets:
            raise SkipStep("no process groups: no DTensor parameters and no groups given")
        return warm_groups(targets, target)

    steps: list[tuple[str, bool, Callable[[], str]]] = [
        ("cublas", cublas, lambda: warm_cublas(target, dtypes)),
        ("comm_groups", comm_groups, comm_step),
        ("fla", fla, lambda: warm_fla(model, target)),
    ]
    cuda_devices = [target.index] if target.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        reports = [
            _run_step(name, fn, target) if enabled else _disabled(name)
            for name, enabled, fn in steps
        ]
    return PrewarmReport(device=str(target), steps=tuple(reports))


def _run_step(name: str, fn: Callable[[], str], device: torch.device) -> StepReport:
    before = _outside_allocator(device)
    start = time.perf_counter()
    status, fields = "ran", {}
    try:
        fields["detail"] = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except SkipStep as skip:
        status, fields = "skipped", {"reason": str(skip)}
    except Exception as exc:
        status = "failed"
        fields = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    seconds = time.perf_counter() - start
    after = _outside_allocator(device)
    return StepReport(name, status, seconds, outside_before=before, outside_after=after, **fields)


def _disabled(name: str) -> StepReport:
    return StepReport(name, "skipped", 0.0, reason=f"disabled ({name}=False)")


def _outside_allocator(device: torch.device) -> int | None:
    """Bytes in use on ``device`` that PyTorch's caching allocator has not reserved."""
    if device.type != "cuda":
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
        return total - free - torch.cuda.memory_reserved(device)
    except RuntimeError:
        return None


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if not isinstance(device, torch.device | str | int) or isinstance(device, bool):
        raise TypeError(
            f"device must be a torch.device, str, int or None, got {type(device).__name__}"
        )
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {resolved}")
    return resolved


def _check_dtypes(dtypes: Iterable[torch.dtype]) -> tuple[torch.dtype, ...]:
    if isinstance(dtypes, torch.dtype):
        raise TypeError(f"dtypes must be a sequence of torch.dtype, got the single dtype {dtypes}")
    out = tuple(dtypes)
    for d in out:
        if not isinstance(d, torch.dtype):
            raise TypeError(f"dtypes must hold torch.dtype objects, got {type(d).__name__} {d!r}")
        if not d.is_floating_point:
            raise ValueError(f"dtypes must be floating-point (matmul dtypes), got {d}")
    return out


def _check_groups(groups: Iterable[dist.ProcessGroup | DeviceMesh]) -> tuple:
    if isinstance(groups, dist.ProcessGroup | DeviceMesh):
        raise TypeError(
            f"groups must be a sequence of ProcessGroup/DeviceMesh, got a single {type(groups).__name__}; wrap it in a list"
        )
    out = tuple(groups)
    for g in out:
        if not isinstance(g, dist.ProcessGroup | DeviceMesh):
            raise TypeError(
                f"groups must hold torch.distributed ProcessGroup or DeviceMesh objects, got {type(g).__name__}"
            )
    return out
