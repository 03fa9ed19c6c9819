"""The planner's world: a fake process group.

:func:`fake_world` is torch's
``fake`` backend: every collective returns at once without data, so ONE CPU process can stand
in for any rank of a 128-rank world while the real parallelize code builds real meshes and
DTensor placements.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

__all__ = ["fake_world"]


@contextlib.contextmanager
def fake_world(world: int, rank: int):
    """A ``fake`` default process group in which this process is ``rank`` of ``world``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the planner makes its own (fake) process group: none may exist")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
