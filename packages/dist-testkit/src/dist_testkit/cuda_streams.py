"""Run code written against CUDA streams on a CPU gloo rank: :func:`cpu_cuda_streams`.

Some libraries (megatron-fsdp is the one this repository tests) create ``torch.cuda.Stream``
objects, enter ``torch.cuda.stream(...)`` contexts, record events and call
``tensor.cuda()`` / ``torch.cuda.synchronize()`` unconditionally, so they cannot even be
constructed on a machine without a GPU, although everything they compute is ordinary tensor
math and ``torch.distributed`` collectives that gloo runs.

Inside :func:`cpu_cuda_streams` those calls get CPU stand-ins: a stream or event that does
nothing, a ``stream(...)`` context that does nothing, ``current_device()`` 0, ``synchronize`` /
``empty_cache`` no-ops, ``Tensor.record_stream`` a no-op and ``Tensor.cuda()`` the tensor itself.

Collectives asked to run asynchronously (``async_op=True``, or coalesced with
``async_ops=True``) complete before they return: gloo would run them on its own thread while the
caller went on, and a library written for CUDA orders such work with streams and events (and
keeps buffers alive with ``record_stream``), all of which are stand-ins here. Measured in a
megatron-fsdp training step on 2 ranks: 62 of its 63 coalesced parameter all-gathers were still
running when the call returned.

Why it is exact: on the CPU every kernel runs to completion, in program order, on the calling
thread before the call returns, and with the collectives completed as above a collective returns
only once its result is written. A stream or event only orders work that would otherwise run
concurrently; here nothing does, so every "wait" is already satisfied and dropping it changes
no value. ``Tensor.cuda()`` returning the tensor keeps it on the process's one device, where
every other tensor of the rank lives. What the stand-ins do NOT test is the library's stream
ordering on a real GPU (a missing ``wait_stream`` there is a race this cannot show): that stays
with the library's own GPU tests.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["cpu_cuda_streams"]


class _CPUEvent:
    """An event whose work is always done (CPU kernels are synchronous)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CPUStream:
    """A stream on which every queued kernel has already run."""

    runs_on_cpu = True  # what a caller may check to know it got the stand-in

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _CPUEvent:
        return event if event is not None else _CPUEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def cpu_cuda_streams() -> Iterator[None]:
    """CPU stand-ins for ``torch.cuda``'s streams, events and device calls (module docstring),
    restored on exit. Refuses on a machine with a GPU, where the real ones must run."""
    if torch.cuda.is_available():
        raise RuntimeError(
            "cpu_cuda_streams() stands in for CUDA streams on a CPU-only machine; this one has "
            "a GPU: run the code on it"
        )
    stream = _CPUStream()
    with contextlib.ExitStack() as stack:
        for owner, name, value in (
            (torch.cuda, "Stream", _CPUStream),
            (torch.cuda, "Event", _CPUEvent),
            (torch.cuda, "stream", lambda s=None: contextlib.nullcontext()),
            (torch.cuda, "current_stream", lambda device=None: stream),
            (torch.cuda, "default_stream", lambda device=None: stream),
            (torch.cuda, "synchronize", lambda device=None: None),
            (torch.cuda, "current_device", lambda: 0),
            (torch.cuda, "empty_cache", lambda: None),
            (torch.Tensor, "record_stream", lambda self, s: None),
            (torch.Tensor, "cuda", lambda self, *args, **kwargs: self),
        ):
            stack.enter_context(mock.patch.object(owner, name, value))
        for name in _COLLECTIVES:
            stack.enter_context(mock.patch.object(dist, name, _completed(getattr(dist, name))))
        coalesced = c10d._CoalescingManager
        stack.enter_context(
            mock.patch.object(coalesced, "append", _appended_completed(coalesced.append))
        )
        yield


# what torch.distributed runs asynchronously when asked (async_op=True)
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "barrier",
)


def _completed(collective):
    """``collective`` whose asynchronous work has completed when it returns. Inside a coalescing
    manager an op is only recorded (an illegal-to-wait placeholder comes back): the manager runs
    the batch at its exit, and :func:`_appended_completed` waits for it there."""

    @functools.wraps(collective)
    def run(*args, **kwargs):
        work = collective(*args, **kwargs)
        if kwargs.get("async_op") and work is not None and not isinstance(work, c10d._IllegalWork):
            work.wait()
        return work

    return run


def _appended_completed(append):
    """A coalescing manager's ``append`` that first waits for the batch's work."""

    def wait_then_append(self, work=None):
        if work:
            work.wait()
        return append(self, work)

    return wait_then_append
