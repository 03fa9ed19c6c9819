"""The planner's world: the recipe's layout at a chosen world size, on a fake process group.

:func:`rescaled` changes only the data-parallel degree (CP, EP, TP and HSDP replicas kept),
refusing with the reason when the world size does not allow it. :func:`fake_world` is torch's
``fake`` backend: every collective returns at once without data, so ONE CPU process can stand
in for any rank of a 128-rank world while the real parallelize code builds real meshes and
DTensor placements.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch.distributed as dist

__all__ = ["fake_world", "rescaled"]


def rescaled(parallel, world: int):
    """``parallel`` with ``dp`` chosen so the layout fills ``world`` ranks; ``ValueError``
    when no data-parallel degree does."""
    per_dp = parallel.dp_replicate * parallel.cp * parallel.tp
    if world < 1 or world % per_dp:
        raise ValueError(
            f"--world-size {world} is not a multiple of parallel.dp_replicate x cp x tp = "
            f"{parallel.dp_replicate} x {parallel.cp} x {parallel.tp} = {per_dp} (kept fixed)"
        )
    return dataclasses.replace(parallel, dp=world // per_dp)


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
