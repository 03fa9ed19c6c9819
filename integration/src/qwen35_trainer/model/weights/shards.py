"""Which elements of a full tensor this rank's shard of a parameter holds.

A parameter after parallelisation is a plain tensor (this rank holds all of it) or a DTensor
whose placements shard some dims over mesh dims — TP ``Shard(0|1)``, EP ``Shard(0)``, FSDP2's
``Shard(0)`` (``_StridedShard`` when FSDP shards a dim TP or EP already split), uneven shards
included. :func:`local_index` gives, per dim, the global index range of the local shard, so
``full[r_0, r_1, ...]`` is exactly ``param.to_local()``. Materialising, loading and exporting
all read or write ONE tensor's slice through it, never the full model.

Why it is exact: every layout here shards a dim by nested ``torch.chunk`` splits — TP and EP
split the full tensor, then FSDP2 chunks the shard it is given along dim 0 (its placement is
``_StridedShard`` when that dim was split already, and it sits on an EARLIER mesh dim than the
TP / EP split it refines). So the local shard is one contiguous block per dim, found by
applying the mesh dims' splits from the last to the first, each taking chunk ``c`` of ``n`` of
the current range with ``torch.chunk``'s sizes (``ceil(len / n)``, the last chunks short or
empty — FSDP2's uneven rule, which DTensor's own offset helper does not follow for empty
chunks). No collective runs, so it also works on the planner's fake process group; the shape
found is checked against the tensor the rank actually holds.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_index", "read_local"]


def local_index(param: torch.Tensor) -> list[range]:
    """Per dim, the global index range of this rank's local shard of ``param``."""
    ranges = [range(n) for n in param.shape]
    if not isinstance(param, DTensor):
        return ranges
    coordinate = param.device_mesh.get_coordinate()
    for mesh_dim in reversed(range(param.device_mesh.ndim)):
        d = getattr(param.placements[mesh_dim], "dim", None)  # Shard and _StridedShard
        if d is None:
            continue
        n, c = param.device_mesh.size(mesh_dim), coordinate[mesh_dim]
        current = ranges[d]
        size = -(-len(current) // n)
        lo = min(current.start + c * size, current.stop)
        ranges[d] = range(lo, min(lo + size, current.stop))
    held = tuple(param.to_local().shape)
    if tuple(len(r) for r in ranges) != held:
        raise RuntimeError(
            f"shard of a {list(param.shape)} tensor placed {param.placements}: the chunk rule "
            f"gives local shape {[len(r) for r in ranges]}, the rank holds {list(held)}"
        )
    return ranges


def read_local(read_rows, index: list[range]) -> torch.Tensor:
    """The local block ``full[index]`` from ``read_rows(lo, hi)`` (full rows ``lo:hi`` of dim 0,
    any dtype): only the dim-0 span of the shard is ever read."""
    block = read_rows(index[0].start, index[0].stop)
    for d, ix in enumerate(index[1:], start=1):
        if len(ix) != block.shape[d]:
            block = block.narrow(d, ix.start, len(ix))
    return block
