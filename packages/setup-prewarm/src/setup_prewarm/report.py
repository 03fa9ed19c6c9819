"""The result of a prewarm: one :class:`StepReport` per step, printable as a table.

A report is plain data (no tensors, no process groups), so it can be pickled, logged and
compared across ranks. Memory "outside the caching allocator" is what the device driver counts
as used minus what PyTorch's caching allocator has reserved: cuBLAS workspaces, NCCL
communicator buffers and Triton's compiled modules land there. It is measured with
``torch.cuda.mem_get_info``, which sees the whole device, so other processes sharing the GPU
are counted too; on CPU it is ``None``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["PrewarmReport", "SkipStep", "StepReport"]

Status = Literal["ran", "skipped", "failed"]
_MIB = 1 << 20


class SkipStep(Exception):
    """Raised by a step that cannot run here; its message is the reason in the report."""


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One prewarm step.

    ``status`` is ``"ran"`` (``detail`` says what ran), ``"skipped"`` (``reason`` says why) or
    ``"failed"`` (``error`` is ``"ExceptionType: message"``, ``traceback`` the full text).
    ``outside_before`` / ``outside_after`` are bytes outside the caching allocator around the
    step, ``None`` when the device is not CUDA.
    """

    name: str
    status: Status
    seconds: float
    detail: str | None = None
    reason: str | None = None
    error: str | None = None
    traceback: str | None = None
    outside_before: int | None = None
    outside_after: int | None = None

    @property
    def note(self) -> str:
        """The one text that goes with the status: detail, reason or error."""
        return {"ran": self.detail, "skipped": self.reason, "failed": self.error}[self.status] or ""

    @property
    def outside_delta(self) -> int | None:
        """Bytes the step added outside the caching allocator (``None`` off CUDA)."""
        if self.outside_before is None or self.outside_after is None:
            return None
        return self.outside_after - self.outside_before


@dataclasses.dataclass(frozen=True)
class PrewarmReport:
    """All steps of one :func:`setup_prewarm.prewarm` call, in the order they ran."""

    device: str
    steps: tuple[StepReport, ...]

    def __getitem__(self, name: str) -> StepReport:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(f"no step named {name!r}; have {[s.name for s in self.steps]}")

    @property
    def ok(self) -> bool:
        """True when no step failed (skipped steps are fine)."""
        return all(s.status != "failed" for s in self.steps)

    @property
    def failed(self) -> tuple[StepReport, ...]:
        return tuple(s for s in self.steps if s.status == "failed")

    def table(self) -> str:
        """A fixed-width text table: step, status, seconds, outside-allocator MiB, note."""
        header = ("step", "status", "seconds", "outside MiB before", "after", "note")
        rows = [header]
        for s in self.steps:
            rows.append(
                (
                    s.name,
                    s.status,
                    f"{s.seconds:.3f}",
                    _mib(s.outside_before),
                    _mib(s.outside_after),
                    s.note,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        lines = [f"prewarm on {self.device}"]
        for i, row in enumerate(rows):
            cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)]
            lines.append("  ".join([*cells, row[-1]]).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in [*widths, len(header[-1])]))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / _MIB:.1f}"
