"""Variable-length all-gather of row blocks, whose backward is a reduce-scatter (sum).

Forward: rank ``r`` holds ``counts[r]`` rows; every rank receives all blocks concatenated in rank
order. Each rank then uses the (identical) gathered tensor in its own way, so the gradient of
the total loss (the sum of every rank's loss) with respect to rank ``r``'s block is the sum, over
all ranks ``q``, of ``q``'s gradient for rows ``r``'s block occupies — a reduce-scatter with sum.

gloo has no uneven reduce-scatter, so the backward is an uneven ``all_to_all_single`` (rank ``q``
sends rows of block ``r`` to rank ``r``) followed by a local sum over the senders, which is the
same sum. The forward pads every block to the largest count for ``all_gather_into_tensor``, the
one gather gloo and NCCL both run on tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["VarlenAllGather", "varlen_all_gather"]


class VarlenAllGather(torch.autograd.Function):
    """``[counts[rank], D] -> [sum(counts), D]``; backward sums each rank's gradient of block ``r``
    and sends it to rank ``r``.

    Forward: all-gather of ``counts[r]`` rows from every rank ``r`` (padded to ``max(counts)``).
    Backward: every rank ``q`` sends rows ``[offset_r, offset_r + counts[r])`` of its incoming
    gradient to rank ``r`` (``all_to_all_single`` with uneven splits); rank ``r`` sums the
    ``world`` blocks it receives, in rank order, into the gradient of its local rows.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        local_LD: torch.Tensor,
        counts: tuple[int, ...],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.counts, ctx.group = counts, group
        world, width = len(counts), max(counts)
        padded_WD = local_LD.new_zeros((width, local_LD.shape[1]))
        padded_WD[: local_LD.shape[0]] = local_LD
        gathered = local_LD.new_empty((world * width, local_LD.shape[1]))
        dist.all_gather_into_tensor(gathered, padded_WD.contiguous(), group=group)
        blocks = gathered.view(world, width, local_LD.shape[1])
        return torch.cat([blocks[r, :c] for r, c in enumerate(counts)])

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_ND: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        counts, group = ctx.counts, ctx.group
        mine = counts[dist.get_rank(group)]
        received = grad_ND.new_empty((len(counts) * mine, grad_ND.shape[1]))
        dist.all_to_all_single(
            received,
            grad_ND.contiguous(),
            output_split_sizes=[mine] * len(counts),
            input_split_sizes=list(counts),
            group=group,
        )
        return received.view(len(counts), mine, grad_ND.shape[1]).sum(0), None, None


def varlen_all_gather(
    local_LD: torch.Tensor, counts: Sequence[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Concatenate every rank's ``local_LD`` (``[counts[rank], D]``) in rank order on all ranks.

    ``counts`` must be the same on every rank and ``local_LD.shape[0] == counts[rank]``.
    Differentiable: see :class:`VarlenAllGather` for where the gradient goes.
    """
    counts = tuple(int(c) for c in counts)
    if len(counts) != dist.get_world_size(group):
        raise ValueError(
            f"counts has {len(counts)} entries, group has {dist.get_world_size(group)} ranks"
        )
    if local_LD.dim() != 2 or local_LD.shape[0] != counts[dist.get_rank(group)]:
        raise ValueError(
            f"local block has shape {tuple(local_LD.shape)}, expected "
            f"[{counts[dist.get_rank(group)]}, D] (counts[rank] rows)"
        )
    return VarlenAllGather.apply(local_LD, counts, group)
