"""The whole tensor of a sharded parameter or gradient, whichever backend sharded it.

FSDP2 shards dim 0 with ``torch.chunk``'s sizes; megatron-fsdp shards flat buffers by element
ranges and exposes each parameter's piece as a DTensor ``Shard(0)`` whose local row counts are
arbitrary (zero on some ranks). ``DTensor.full_tensor()`` assumes the ``torch.chunk`` sizes, so
on megatron-fsdp's tensors it is wrong, and megatron-fsdp's own gather calls an uneven
``all_gather`` that gloo does not run.

:func:`full_tensor` handles both with ordinary collectives. Correctness argument: both backends
place the shards of a dim-0-sharded tensor in RANK ORDER along dim 0, each rank holding one
contiguous block of whole rows (FSDP2: chunk ``r`` of ``n``; megatron-fsdp: the rows of its
element range, whose offset is the sum of the lower ranks' rows). So gathering every rank's row
count, padding each block to the largest one, one equal-size ``all_gather`` and concatenating
each rank's first ``rows[r]`` rows in rank order rebuilds the tensor; the row counts must add up
to the global dim 0, which is checked (a layout that is not rank-ordered blocks fails there
rather than returning a shuffled tensor). Tensors sharded on another dim or on several mesh
dims (TP, EP inside FSDP) go to ``DTensor.full_tensor()``, which is right for them. Every rank
takes the same branch (it depends on placements only) and the collectives run on tensors of the
group's device. A float8 tensor (a frozen FP8 weight) is gathered as its bytes: gloo has no
float8 type, and the bytes are the values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["full_tensor"]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``: a plain tensor as is, a DTensor gathered (module docstring). Every
    rank of ``t``'s mesh must call it."""
    if not isinstance(t, DTensor):
        return t
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:  # float8: as bytes
        local = t.to_local().detach().view(torch.uint8)
        as_bytes = DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
        return full_tensor(as_bytes).view(t.dtype)
    sharded = [i for i, p in enumerate(t.placements) if not p.is_replicate()]
    if len(sharded) != 1 or getattr(t.placements[sharded[0]], "dim", None) != 0:
        return t.full_tensor()
    group = t.device_mesh.get_group(sharded[0])
    local = t.to_local().detach()
    n = dist.get_world_size(group)
    rows = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
    all_rows = [torch.empty_like(rows) for _ in range(n)]
    dist.all_gather(all_rows, rows, group=group)
    counts = [int(r) for r in all_rows]
    if sum(counts) != t.shape[0]:
        raise RuntimeError(
            f"a {list(t.shape)} DTensor placed {t.placements}: the ranks hold {counts} rows of "
            f"dim 0, not {t.shape[0]} in all"
        )
    padded = local.new_zeros((max(counts), *t.shape[1:]))
    padded[: local.shape[0]] = local
    blocks = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(blocks, padded.contiguous(), group=group)
    return torch.cat([b[:c] for b, c in zip(blocks, counts, strict=True)])
