"""The host memory a block of code takes: :func:`host_memory`.

CPU memory is measured as this process's resident set (RSS), which counts every allocation,
torch's or not. Linux keeps the RSS high-water mark (``VmHWM`` in ``/proc/self/status``), and
writing ``5`` to ``/proc/self/clear_refs`` resets that mark to the current RSS. So, from the RSS
before the block: ``peak`` = the high-water mark after it minus that RSS, ``held`` = the RSS
after it minus that RSS. Both count pages actually touched (an allocated, untouched tensor
costs nothing until written), which is what a machine's memory limit sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["HostMemory", "host_memory"]


@dataclasses.dataclass
class HostMemory:
    """Bytes above the RSS before the block: its peak, and what it still held at the end
    (both filled when the block ends)."""

    peak: int = 0
    held: int = 0


@contextmanager
def host_memory() -> Iterator[HostMemory]:
    """``with host_memory() as used: ...`` then ``used.peak`` / ``used.held`` in bytes (module
    docstring). Linux only (``/proc``)."""
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the high-water mark is now the current RSS
    used = HostMemory()
    yield used
    used.peak, used.held = _status("VmHWM") - before, _status("VmRSS") - before


def _status(field: str) -> int:
    """A ``/proc/self/status`` field given in kB, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/self/status has no {field}")
