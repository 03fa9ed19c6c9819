"""``LinearCrossEntropy``: an lm_head plus its loss, as one module that FSDP2 can shard.

The loss needs the whole (or TP-local) ``lm_head.weight``. Under FSDP2 that weight is a
DP-sharded DTensor except between the pre- and post-forward hooks of the module that owns its
parameter group, so the weight is only read inside those hooks:

- ``fully_shard(loss_module)`` (or a parent of it, with the lm_head in the parent's group): the
  module's own ``forward`` runs between the hooks, the weight is the unsharded parameter, and
  FSDP2 reduce-scatters its gradient as for an ``nn.Linear``.
- ``fully_shard(loss_module.lm_head)`` (the lm_head is its own unit): the loss is run as a
  method of the lm_head registered with ``register_fsdp_forward_method``, so the lm_head's
  hooks all-gather before and reshard after, and register the backward hooks on the loss.

Either way the weight seen by ``linear_cross_entropy`` is exactly the unsharded one, so loss and
gradients equal the unsharded module's. A weight that is still a DTensor there is taken as
vocab-parallel (TP) — that is the TP plan's layout, not FSDP's.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from chunked_loss._checks import check_options
from chunked_loss.linear import linear_cross_entropy

__all__ = ["LinearCrossEntropy"]

_HEAD_METHOD = "chunked_loss_forward"


class LinearCrossEntropy(nn.Module):
    """Wraps an ``lm_head`` ``nn.Linear(H, V)``; ``forward(hidden, labels)`` returns the loss.

    Build it around a model's lm_head (``LinearCrossEntropy(model.lm_head)``) or let it own a new
    one (``LinearCrossEntropy.create(H, V)``). The options are those of ``linear_cross_entropy``.
    """

    def __init__(
        self,
        lm_head: nn.Linear,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        chunk_size: int | None = None,
        label_smoothing: float = 0.0,
        grad_in_forward: bool | None = None,
        compiled: bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(lm_head, nn.Linear):
            raise TypeError(f"lm_head must be an nn.Linear, got {type(lm_head).__name__}")
        check_options(reduction, chunk_size, label_smoothing, None)
        self.lm_head = lm_head
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.chunk_size = chunk_size
        self.label_smoothing = label_smoothing
        self.grad_in_forward = grad_in_forward
        self.compiled = compiled

    @classmethod
    def create(
        cls,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **options,
    ) -> LinearCrossEntropy:
        """A new module owning ``nn.Linear(in_features, out_features, bias=bias)``."""
        head = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        return cls(head, **options)

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        num_valid_tokens: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden`` [N, H] or [B, S, H], ``labels`` [N] or [B, S] → loss (see ``reduction``)."""
        head = self.lm_head
        options = {
            "ignore_index": self.ignore_index,
            "reduction": self.reduction,
            "chunk_size": self.chunk_size,
            "label_smoothing": self.label_smoothing,
            "num_valid_tokens": num_valid_tokens,
            "grad_in_forward": self.grad_in_forward,
            "compiled": self.compiled,
        }
        if isinstance(head, FSDPModule):
            if not hasattr(head, _HEAD_METHOD):
                # A plain attribute of the head: register_fsdp_forward_method wraps it in the
                # head's FSDP pre/post-forward hooks (all-gather, reshard, backward hooks).
                object.__setattr__(head, _HEAD_METHOD, functools.partial(_head_loss, head))
                register_fsdp_forward_method(head, _HEAD_METHOD)
            return getattr(head, _HEAD_METHOD)(hidden, labels, options)
        return _head_loss(head, hidden, labels, options)

    def extra_repr(self) -> str:
        return (
            f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
            f"chunk_size={self.chunk_size}, label_smoothing={self.label_smoothing}, "
            f"grad_in_forward={self.grad_in_forward}, compiled={self.compiled}"
        )


def _head_loss(head: nn.Linear, hidden, labels, options: dict) -> torch.Tensor:
    """The loss with the head's parameters as they are at call time (unsharded inside hooks)."""
    return linear_cross_entropy(hidden, head.weight, labels, bias=head.bias, **options)
