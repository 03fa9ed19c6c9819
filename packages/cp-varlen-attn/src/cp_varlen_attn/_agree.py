"""Input checks that all ranks of a group agree on before anyone raises.

A rank that raises on bad input while its peers enter the next collective leaves them hanging
until the process-group timeout. Every rank therefore reports its local verdict through one tiny
all-reduce; if any rank found a problem, every rank raises — the ones that found nothing say
which ranks did.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["agree_or_raise"]


def agree_or_raise(error: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError(error)`` on every rank of ``group`` if any rank passes a non-None error."""
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise ValueError(error)
        return
    world = dist.get_world_size(group)
    flags = torch.zeros(world, dtype=torch.int32)
    flags[dist.get_rank(group)] = int(error is not None)
    dist.all_reduce(flags, group=group)
    bad = [r for r in range(world) if flags[r]]
    if not bad:
        return
    if error is not None:
        raise ValueError(error)
    raise ValueError(
        f"invalid input on rank(s) {bad} of the group (see their error); raising here too so no rank hangs"
    )
