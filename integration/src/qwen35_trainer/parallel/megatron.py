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
- **Precision.** fp32: one fp32 buffer is both the compute and the optimizer's weights
  (``main_params_dtype=None``; megatron-fsdp's default keeps a second fp32 copy). bf16
  (``train.dtype: bfloat16``): megatron-fsdp computes in the model's own dtype, so the meta
  parameters are cast to bf16 (the rotary buffers stay fp32, as under FSDP2), with fp32 main
  weights and gradients, reduced in fp32 — FSDP2's bf16 step (bf16 compute over fp32 sharded
  weights, fp32 reduction). The main weights start from the fp32 values, not the bf16-rounded
  ones: the filler hands each value to megatron-fsdp through the parameter's
  ``get_high_precision_init_val``, the hook its FP8 parameters use.
- **Sharding.** :func:`fsdp_compat.shard_model` with ``backend="megatron-fsdp"`` over
  ``dp_shard × cp`` (the dense mesh's size-1 ``tp`` dim is its TP dim), replicated over
  ``dp_replicate`` (HSDP: megatron-fsdp's outer DP), the decoder layers and vision blocks as
  units, ``grad_reduction="sum"`` (no gradient scaling: reductions are plain sums of the ranks'
  shares, the one-process gradient).
- **HSDP and accumulation.** megatron-fsdp sums the replicas' gradients by an in-place
  all-reduce of its accumulating gradient buffer, on the backward it is told is the step's
  last: the step runs every other micro-batch's backward inside
  :func:`fsdp_compat.accumulating` (unmarked, the replicas were never summed: grad norm 0.650
  against one process's 0.958; marked on every one, the earlier micro-batches would be summed
  again at each later one).
- **Which parameters are in place.** megatron-fsdp swaps the module's parameters: whole
  compute parameters for forward and backward, its distributed ``Shard(0)`` DTensors after the
  gradient sync. Its wrapper's ``forward`` makes the first swap; the trainer calls the
  objective itself (step, evaluation), so a forward pre-hook on the objective makes the same
  swap. :func:`place_distributed` makes the second before the weights are read (export).
- **Compiled blocks** (``train.compile``) are compiled before the sharding, as under FSDP2:
  megatron-fsdp swaps the parameters around the blocks' forwards, never inside them, so each
  compiled forward sees whole compute parameters (``TORCH_LOGS=recompiles`` on a DP 2 parity
  run: every recompilation came from the rows' lengths or the mask's dtype, none from a swap).
- **Checkpoints** are the trainer's DCP checkpoints: :func:`fsdp_compat.dcp_ready` gives the
  uneven shards their true offsets, and megatron-fsdp's own hooks put its distributed
  parameters in place for ``state_dict`` and install the loaded ones with ``load_state_dict``;
  background checkpoints are refused, untested: DCP's stager copies a CUDA DTensor's local
  shard to the host, but deep-copies a CPU one with its whole storage, which on the CPU test
  ranks is a megatron-fsdp flat buffer and fails ("Attempted to call copy_() on an invalid
  python storage"), so the path a GPU run would take cannot run here.
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
    if t.async_checkpoint and (
        t.checkpoint_dir is not None or (t.output_dir and t.checkpoint_every)
    ):
        reasons.append(
            "train.async_checkpoint=true is not tested on megatron-fsdp: DCP's background "
            "stager copies a CUDA shard to the host, a path the CPU test ranks cannot run (a "
            "CPU shard, a view of megatron-fsdp's flat buffer, is deep-copied with the whole "
            "buffer and fails); set train.async_checkpoint=false"
        )
    return reasons


def shard_megatron(
    objective: nn.Module,
    meshes: Meshes,
    device: torch.device,
    units: tuple[str, ...],
    filler: Callable[[], Callable[..., None]],
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard the meta ``objective`` with megatron-fsdp (HSDP when ``dp_replicate > 1``),
    materialising it unit by unit on ``device`` with ``fill = filler()`` (``fill(module,
    keep)`` fills a materialised module's own parameters; module docstring), computing in
    ``param_dtype`` (bf16) over fp32 main weights and gradients when given, and make calling
    ``objective`` put the compute parameters in place; the wrapper (also kept as
    ``objective.megatron``)."""
    fill = filler()  # the checkpoint planned and checked on every rank before any sharding
    owners = [m for m in objective.modules() if next(m.parameters(recurse=False), None) is not None]
    if param_dtype is None:
        # fp32 throughout: the weight buffer is the optimizer's (no second fp32 copy)
        policy, keep = MixedPrecision(main_params_dtype=None), None
    else:
        policy, keep = _low_precision(owners, param_dtype), _keep_full_precision
    for module in owners:  # an instance attribute: it shadows torch's own method
        vars(module)["reset_parameters"] = partial(fill, module, keep)
    try:
        wrapper = shard_model(
            objective,
            meshes.dense,
            backend="megatron-fsdp",
            shard_dims=(MeshAxis.DP_SHARD, MeshAxis.CP),
            replicate_dims=(MeshAxis.DP_REPLICATE,) if meshes.dims.dp_replicate > 1 else (),
            unit_modules=list(units),
            grad_reduction="sum",
            mixed_precision=policy,
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


def _low_precision(owners: list[nn.Module], dtype: torch.dtype) -> MixedPrecision:
    """Cast the (meta) parameters of ``owners`` to ``dtype``, megatron-fsdp's compute dtype
    (the buffers stay fp32, as under FSDP2's mixed precision), and the policy that keeps fp32
    main weights and gradients, reduced in fp32."""
    for module in owners:
        for attr, param in list(module.named_parameters(recurse=False)):
            module._parameters[attr] = nn.Parameter(
                param.to(dtype), requires_grad=param.requires_grad
            )
    return MixedPrecision(
        param_dtype=dtype,
        reduce_dtype=torch.float32,
        main_params_dtype=torch.float32,
        main_grads_dtype=torch.float32,
    )


def _keep_full_precision(param: nn.Parameter, value: torch.Tensor) -> None:
    """Hand megatron-fsdp ``param``'s value before its cast to the compute dtype: it fills the
    fp32 main weights from ``param.get_high_precision_init_val()`` where a parameter has it
    (the hook its FP8 parameters use), else from the rounded parameter."""
    vars(param)["get_high_precision_init_val"] = lambda: value
    vars(param)["clear_high_precision_init_val"] = lambda: _forget(param)


def _forget(param: nn.Parameter) -> None:
    del vars(param)["get_high_precision_init_val"], vars(param)["clear_high_precision_init_val"]


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
