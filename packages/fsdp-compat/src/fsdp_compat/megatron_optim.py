"""The optimizer and the gradient sync of a megatron-fsdp model, without its first-step drift.

megatron-fsdp keeps two sets of parameters: the module's compute parameters (views of the
all-gathered weight buffer, in place during forward and backward) and the DISTRIBUTED ones (its
uneven ``Shard(0)`` DTensors over the sharded main weights, in place after
``finish_grad_sync``). Gradients are reduced into a flat buffer and only reach the distributed
parameters' ``.grad`` in ``finish_grad_sync``; an optimizer step changes the main weights, which
reach the compute buffer only through ``install_optimized_model_weights``.

Its own ``fully_shard(module, optimizer)`` wires that up, but it also (0.5.1 and 0.6.1, checked)
replaces the optimizer's parameter groups with ONE group of every parameter (a weight-decay-free
group, a per-group learning rate are lost) and takes one optimizer step on zero gradients to
create the state: Adam's step count then starts at 1, so its first real update is scaled by
other bias corrections than one process's (measured: parameters off by 1.3e-2 after one Adam
step at lr 0.05), and AdamW decays the weights once more. Training silently diverges from the
FSDP2 run of the same recipe, so :func:`attach_optimizer` wires it here instead:

- each group's parameters are re-pointed, by name, at the distributed parameters; the groups and
  their hyperparameters are kept and no step is taken (the state is created by the first real
  step, as FSDP2's path and one process do);
- ``step`` first completes the gradient sync (:func:`finish_grad_sync`; the caller may have
  done it already, e.g. to clip) and then installs the updated weights into the compute buffer;
- ``zero_grad`` also zeroes megatron-fsdp's gradient buffer (otherwise the next backward would
  add onto the reduced gradients of this step: a step whose update was skipped still clears).
"""

from __future__ import annotations

import types

import torch
from torch import nn

__all__ = ["attach_optimizer", "finish_grad_sync", "megatron_wrapper"]


def megatron_wrapper(model: nn.Module) -> nn.Module | None:
    """The ``MegatronFSDP`` wrapper ``model`` is (or holds as its root), or ``None``."""
    return model if hasattr(model, "install_optimized_model_weights") else None


def finish_grad_sync(model: nn.Module) -> None:
    """Make the sharded model's gradients complete on its (distributed) parameters.

    FSDP2 / no wrapper: nothing to do, the reduce-scatters end with ``backward``. megatron-fsdp:
    its ``finish_grad_sync`` (wait for or run the reductions, attach the reduced shards as the
    distributed parameters' ``.grad``, put those parameters in place). A second call before
    the next backward changes nothing (the reductions write the gradient shards, they do not
    add to them; the parity test syncs before clipping and again in the optimizer's step, with
    the reductions asynchronous and synchronous). A rank whose shard of a parameter is empty
    gets an empty gradient for it, as under FSDP2: every rank's optimizer then keeps state for
    every parameter, so the ranks' checkpoints name the same tensors."""
    wrapper = megatron_wrapper(model)
    if wrapper is None:
        return
    wrapper.finish_grad_sync()
    for _, param in wrapper.param_and_grad_buffer.optimizer_named_parameters:
        if param.grad is None and param.requires_grad:  # an empty shard: megatron-fsdp sets none
            param.grad = torch.zeros_like(param)


def attach_optimizer(wrapper: nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str]):
    """Re-point ``optimizer`` (built on the unsharded parameters; ``names``: their ids → names in
    the wrapped module) at ``wrapper``'s distributed parameters and make its ``step`` /
    ``zero_grad`` drive the wrapper (module docstring). In place; returns ``optimizer``."""
    distributed = dict(wrapper.param_and_grad_buffer.optimizer_named_parameters)
    for group in optimizer.param_groups:
        group["params"] = [distributed[names[id(p)]] for p in group["params"]]
    base_step, base_zero_grad = type(optimizer).step, type(optimizer).zero_grad

    def step(self, *args, **kwargs):
        finish_grad_sync(wrapper)
        result = base_step(self, *args, **kwargs)
        wrapper.install_optimized_model_weights()
        return result

    def zero_grad(self, set_to_none: bool = True):
        base_zero_grad(self, set_to_none=set_to_none)
        wrapper.zero_grad_buffer()

    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    return optimizer
