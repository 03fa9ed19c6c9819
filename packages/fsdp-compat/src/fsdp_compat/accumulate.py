"""Gradient accumulation over micro-batches, the same on both backends.

The contract: after a plain ``backward`` on a sharded model the gradients are complete (every
reduction the step needs has run or is queued for :func:`fsdp_compat.finish_grad_sync`);
backward passes inside :func:`accumulating` ADD to the gradients, and the first backward
outside it completes the sum. A step of ``n`` micro-batches runs the first ``n - 1`` backward
passes inside it and the last one outside.

Why a backend needs telling:

- **FSDP2** reduces every backward completely (reduce-scatter over the shard dims, all-reduce
  over the replicas) and adds the result to the sharded gradients: a sum of reduced
  micro-batch gradients is the reduced sum. Nothing to do.
- **megatron-fsdp** reduce-scatters every backward into its sharded gradient buffer, which
  accumulates. Over the replicas of HSDP it all-reduces that buffer IN PLACE, and only on a
  backward it is told is the last (``is_last_microbatch``) or on every backward with
  ``sync_model_each_microbatch`` (``model_auto_sync``). Unmarked, the replicas' gradients are
  never summed (measured in the trainer: grad norm 0.650 against one process's 0.958 at DP 2 x
  replicas 2); marked on every backward of an accumulating step, the earlier micro-batches'
  gradients are all-reduced again at each later one (counted ``replicas`` times over).
  :func:`fsdp_compat.shard_model` therefore marks every backward last (a step of one
  micro-batch needs nothing), and :func:`accumulating` unmarks the backward passes inside it
  and holds the per-micro-batch auto sync off, restoring both on exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from fsdp_compat.megatron_optim import megatron_wrapper

__all__ = ["accumulating"]


@contextmanager
def accumulating(model: nn.Module) -> Iterator[None]:
    """Backward passes inside add to the gradients; the next one outside completes the step's
    reductions (module docstring). ``model``: what :func:`fsdp_compat.shard_model` returned.
    FSDP2 (or an unsharded model): nothing changes."""
    wrapper = megatron_wrapper(model)
    if wrapper is None:
        yield
        return
    auto_sync = wrapper.model_auto_sync
    wrapper.is_last_microbatch, wrapper.model_auto_sync = False, False
    try:
        yield
    finally:
        wrapper.is_last_microbatch, wrapper.model_auto_sync = True, auto_sync
