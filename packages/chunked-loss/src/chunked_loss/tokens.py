"""The global number of valid label tokens, for ``num_valid_tokens``.

With ``reduction="mean"`` each rank and micro-batch divides its loss sum by the same global
count ``T`` (all DP/CP ranks, all micro-batches of the step). The step's gradient is then the
SUM over micro-batches and ranks of ``∂(Σ_i loss_i / T)`` = ``∂(Σ_all loss_i) / T``: exactly
the gradient of one big batch's mean loss, however the tokens are split. (Dividing by the local
count instead weights tokens of short micro-batches more.) Frameworks that AVERAGE gradients
over DP ranks (DDP, FSDP) need the loss multiplied by the DP size to get the sum.

Ranks that hold the same tokens (TP peers) must not be counted twice: pass the group of ranks
that hold different tokens (the DP×CP group), not the world, when TP > 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["global_num_valid_tokens"]


def global_num_valid_tokens(
    labels: torch.Tensor | Sequence[torch.Tensor],
    *,
    ignore_index: int = -100,
    group: dist.ProcessGroup | DeviceMesh | None = None,
) -> int:
    """Count labels != ``ignore_index`` over the given micro-batches and all ranks of ``group``.

    Args:
        labels: one labels tensor (any shape, e.g. [B, S]) or a sequence of them (this rank's
            micro-batches of the step).
        group: process group or 1-D ``DeviceMesh`` of the ranks holding different tokens;
            default: the whole world when ``torch.distributed`` is initialised, else none.

    Returns:
        The global count, identical on every rank of ``group``. One all-reduce of one int64.
    """
    batches = [labels] if isinstance(labels, torch.Tensor) else list(labels)
    if not batches:
        raise ValueError("labels must be a tensor or a non-empty sequence of tensors, got none")
    for i, t in enumerate(batches):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dtype == torch.bool:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"labels[{i}] must be an integer tensor, got {got}")
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group must be a 1-D DeviceMesh (flatten dp and cp first), got dims {group.mesh_dim_names}"
            )
        group = group.get_group()
    device = batches[0].device
    count = torch.zeros((), dtype=torch.int64, device=device)
    for t in batches:
        count += (t.to(device) != ignore_index).sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    elif group is not None:
        raise ValueError("a group was given but torch.distributed is not initialised")
    return int(count.item())
