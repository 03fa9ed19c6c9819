"""Build a CPU ``DeviceMesh`` with named dims inside a launched rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["make_mesh"]


def make_mesh(shape: Sequence[int], names: Sequence[str]) -> DeviceMesh:
    """``init_device_mesh("cpu", shape, mesh_dim_names=names)`` with its preconditions checked.

    Call it inside a function run by :func:`dist_testkit.run_ranks` (the default process group
    must exist). ``prod(shape)`` must equal the world size.
    """
    shape, names = tuple(int(s) for s in shape), tuple(names)
    if len(shape) != len(names):
        raise ValueError(f"mesh shape {shape} and names {names} differ in length")
    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs an initialised process group (run it inside run_ranks)")
    size = 1
    for s in shape:
        size *= s
    if size != dist.get_world_size():
        raise ValueError(
            f"mesh shape {shape} holds {size} ranks, world size is {dist.get_world_size()}"
        )
    return init_device_mesh("cpu", shape, mesh_dim_names=names)
