"""megatron-fsdp as the sharding backend (``parallel.fsdp_backend: megatron``), in one place.

The trainer's step is the FSDP2 one (shares of the global loss, SUM reductions; see
:mod:`qwen35_trainer.parallel.apply`); what megatron-fsdp does differently, and how each
difference is met:

- **Materialisation.** megatron-fsdp shards flat buffers by element ranges that it copies out
  of whole parameters. From the meta device (``init_model_with_meta_device``) it goes parameter
  group by group (a unit: a decoder layer, a vision block, the rest of the model): it
  allocates each module's own parameters whole and calls the module's ``reset_parameters``,
  copies this rank's ranges into its buffer, and lets the whole tensors go. transformers'
  modules have no such method, and torch's (``nn.Linear``'s, ...) draw other values: for the
  sharding only, every module with parameters of its own gets a ``reset_parameters`` that fills
  them by name exactly as one process does (name-seeded, or read from ``model.weights``;
  :func:`qwen35_trainer.model.build.module_filler`), removed again once sharded. So every rank
  holds the one-process weights, and at most one unit whole besides its shards.
- **Sharding.** :func:`fsdp_compat.shard_model` with ``backend="megatron-fsdp"`` over
  ``dp_shard × cp`` (the dense mesh's size-1 ``tp`` dim is its TP dim), the decoder layers and
  vision blocks as units, ``grad_reduction="sum"`` (no gradient scaling: reductions are plain
  sums of the ranks' shares, the one-process gradient).
- **Which parameters are in place.** megatron-fsdp swaps the module's parameters: whole
  compute parameters for forward and backward, its distributed ``Shard(0)`` DTensors after the
  gradient sync. Its wrapper's ``forward`` makes the first swap; the trainer calls the
  objective itself (step, evaluation), so a forward pre-hook on the objective makes the same
  swap. :func:`place_distributed` makes the second before the weights are read (export).
- **The backward's bookkeeping** (which gradients a backward reduces) starts from a hook
  megatron-fsdp attaches to the output tensors of the modules holding every parameter, found
  in Tensor / tuple / list outputs only: the objective returns a ``NamedTuple``
  (:class:`~qwen35_trainer.model.objective.LossShares`; with a dataclass, two micro-batches per
  step gave gradients 30-70x off).
- **Gradients** reach the distributed parameters in ``finish_grad_sync``
  (:func:`fsdp_compat.finish_grad_sync`), which the step calls once, before clipping (not
  megatron-fsdp after every micro-batch: ``sync_model_each_microbatch=False``); the optimizer
  is built on the distributed parameters and wired by
  :func:`fsdp_compat.megatron_optim.attach_optimizer` (its groups kept, sync before and weight
  install after ``step``, the gradient buffer zeroed with ``zero_grad``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from fsdp_compat import MixedPrecision, shard_model
from fsdp_compat.megatron_optim import attach_optimizer
from qwen35_trainer.parallel.dims import MeshAxis, Meshes

__all__ = ["megatron_refusals", "place_distributed", "shard_megatron", "wire_optimizer"]


def megatron_refusals(recipe) -> list[str]:
    """Why ``recipe`` cannot train with ``parallel.fsdp_backend: megatron`` (empty: it can, or
    it uses FSDP2). What is refused is what the parity tests do not train on megatron-fsdp."""
    p = recipe.parallel
    if p.fsdp_backend != "megatron":
        return []
    t = recipe.train
    use = "; use parallel.fsdp_backend=fsdp2"
    reasons = []
    if p.ep > 1 or p.tp > 1:
        reasons.append(
            "parallel.fsdp_backend=megatron runs with parallel.ep=1 and parallel.tp=1: the "
            "trainer's expert mesh and its TP gradient rules are FSDP2's (megatron-fsdp derives "
            "its expert groups itself)" + use
        )
    if p.dp_replicate > 1:
        reasons.append(
            "parallel.fsdp_backend=megatron shards over parallel.dp x parallel.cp only: "
            "replicas (parallel.dp_replicate > 1, megatron-fsdp's outer DP) are not trained on "
            "it here" + use
        )
    if t.dtype == "bfloat16":
        reasons.append(
            "parallel.fsdp_backend=megatron trains in float32 here: megatron-fsdp computes in "
            "the model's own dtype, so the trainer's bf16 (bf16 compute over fp32 sharded "
            "weights) is FSDP2's" + use
        )
    if t.compile:
        reasons.append(
            "train.compile=true is not trained on megatron-fsdp (its parameter swaps and "
            "hooks inside compiled blocks are untested)" + use
        )
    if t.checkpoint_dir is not None or (t.output_dir and t.checkpoint_every):
        reasons.append(
            "checkpoints are not written on megatron-fsdp yet: the trainer's DCP checkpoints "
            "hold FSDP2's shards, megatron-fsdp's uneven element-range shards need its own "
            "state-dict preprocessing (unset train.checkpoint_dir and train.checkpoint_every)" + use
        )
    return reasons


def shard_megatron(
    objective: nn.Module,
    meshes: Meshes,
    device: torch.device,
    units: tuple[str, ...],
    filler: Callable[[], Callable[[nn.Module], None]],
) -> nn.Module:
    """Shard the meta ``objective`` with megatron-fsdp, materialising it unit by unit on
    ``device`` with ``fill = filler()`` (``fill(module)`` fills a materialised module's own
    parameters; module docstring), and make calling ``objective`` put the compute parameters
    in place; the wrapper (also kept as ``objective.megatron``)."""
    fill = filler()  # the checkpoint planned and checked on every rank before any sharding
    owners = [m for m in objective.modules() if next(m.parameters(recurse=False), None) is not None]
    for module in owners:  # an instance attribute: it shadows torch's own method
        vars(module)["reset_parameters"] = partial(fill, module)
    try:
        wrapper = shard_model(
            objective,
            meshes.dense,
            backend="megatron-fsdp",
            shard_dims=(MeshAxis.DP_SHARD, MeshAxis.CP),
            unit_modules=list(units),
            grad_reduction="sum",
            # fp32 throughout: the weight buffer is the optimizer's (no second fp32 copy)
            mixed_precision=MixedPrecision(main_params_dtype=None),
            tp_dim=MeshAxis.TP,
            device=device,
            init_model_with_meta_device=True,
            # the step syncs once, before clipping (not after every micro-batch's backward)
            sync_model_each_microbatch=False,
        )
    finally:
        for module in owners:
            del vars(module)["reset_parameters"]
    # what the wrapper's forward does before calling the objective's
    objective.register_forward_pre_hook(
        lambda module, args: wrapper._replace_param_with_raw_if_needed(), prepend=True
    )
    vars(objective)["megatron"] = wrapper  # a plain attribute: the wrapper holds the objective
    return wrapper


def place_distributed(objective: nn.Module) -> None:
    """Put megatron-fsdp's distributed parameters in place (after an evaluation's forward the
    compute ones are); nothing to do under FSDP2."""
    wrapper = getattr(objective, "megatron", None)
    if wrapper is not None:
        wrapper._replace_param_with_distributed_if_needed()


def wire_optimizer(objective: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Under megatron-fsdp: make ``optimizer`` (built on ``objective``'s distributed
    parameters) sync before and install after its step, and zero megatron-fsdp's gradient
    buffer with its ``zero_grad``; nothing to do under FSDP2."""
    wrapper = getattr(objective, "megatron", None)
    if wrapper is not None:
        attach_optimizer(wrapper, optimizer, {id(p): n for n, p in objective.named_parameters()})
