"""Which elements of a full tensor this rank's shard of a parameter holds.

A parameter after parallelisation is a plain tensor (this rank holds all of it) or a DTensor
whose placements shard some dims over mesh dims — TP ``Shard(0|1)``, EP ``Shard(0)``, FSDP2's
``Shard(0)`` (``_StridedShard`` when FSDP shards a dim TP or EP already split), uneven shards
included. :func:`local_index` gives, per dim, the global index range of the local shard, so
``full[r_0, r_1, ...]`` is exactly ``param.to_local()``. Materialising, loading and exporting
all read or write ONE tensor's slice through it, never the full model.

Why it is exact: every layout here shards a dim by nested ``torch.chunk`` splits (FSDP2 chunks
the TP / EP shard it is given), so each local shard is a contiguous block per dim; torch's own
``compute_local_shape_and_global_offset`` gives its offset and shape from the placements
(strided and uneven shards included) without any collective, so it also runs on the planner's
fake process group. The shape it gives is checked against the actual local tensor.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["local_index", "read_local"]


def local_index(param: torch.Tensor) -> list[range]:
    """Per dim, the global index range of this rank's local shard of ``param``."""
    if not isinstance(param, DTensor):
        return [range(n) for n in param.shape]
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    if tuple(shape) != tuple(param.to_local().shape):
        raise RuntimeError(
            f"shard of a {list(param.shape)} tensor placed {param.placements}: torch gives "
            f"local shape {list(shape)}, the rank holds {list(param.to_local().shape)}"
        )
    return [range(o, o + n) for o, n in zip(offset, shape, strict=True)]


def read_local(read_rows, index: list[range]) -> torch.Tensor:
    """The local block ``full[index]`` from ``read_rows(lo, hi)`` (full rows ``lo:hi`` of dim 0,
    any dtype): only the dim-0 span of the shard is ever read."""
    block = read_rows(index[0].start, index[0].stop)
    for d, ix in enumerate(index[1:], start=1):
        if len(ix) != block.shape[d]:
            block = block.narrow(d, ix.start, len(ix))
    return block
