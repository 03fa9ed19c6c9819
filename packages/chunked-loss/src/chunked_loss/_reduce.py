"""Reduction of per-token losses, shared by both entry points.

"mean" divides the sum by the number of valid tokens: the local count, or ``num_valid_tokens``
(the global count over all DP/CP ranks and micro-batches) when given. A count of 0 means every
label is ignored, so the sum is 0 and it is divided by 1: the loss is 0 with zero gradients,
where ``F.cross_entropy`` would return NaN.
"""

from __future__ import annotations

import torch


def reduce_loss(
    loss_N: torch.Tensor,
    labels: torch.Tensor,
    reduction: str,
    ignore_index: int,
    num_valid_tokens: int | torch.Tensor | None,
) -> torch.Tensor:
    """``loss_N`` [N] per-token losses (0 where ignored), or their sum as a scalar; ``labels``
    [N] or [B, S]."""
    if reduction == "none":
        return loss_N.view(labels.shape)
    total = loss_N.sum() if loss_N.dim() else loss_N
    if reduction == "sum":
        return total
    if num_valid_tokens is None:
        count = (labels != ignore_index).sum()
    elif isinstance(num_valid_tokens, torch.Tensor):
        count = num_valid_tokens.reshape(())
    else:
        return total / max(num_valid_tokens, 1)
    return total / count.clamp(min=1).to(device=total.device, dtype=total.dtype)
