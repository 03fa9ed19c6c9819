"""Apply a run's parallelism to the model, in the repository's fixed order: TP (with SP), EP,
AC, FSDP.

:func:`parallelize` is the one entry point: it validates the recipe's layout against the
launch (:func:`validate_layout`, every reason in one message), builds the meshes
(:class:`~qwen35_trainer.parallel.dims.ParallelDims`; one process too, on its one-rank group:
the same program as every layout) and applies, in place:

- TP (``tp > 1``): :func:`~qwen35_trainer.parallel.tp_plan.tp_plan` on the dense mesh's "tp"
  dim — attention heads and the shared expert split, routed experts and routers never — and
  every Gated DeltaNet layer split by heads (:mod:`qwen35_trainer.parallel.tp_gdn`); with
  sequence parallelism (``parallel.sequence_parallel``, on whenever ``tp > 1``) in their SP
  form, and the decoder stack and each MTP layer made SP regions whose residual stream holds
  1/tp of the tokens (:mod:`qwen35_trainer.parallel.sequence_parallel`; the regions' entry and
  exit hooks go on the layers after AC wraps them, so the exit's all-gather is not recomputed);
- EP (``ep > 1``): every MoE's routed experts ``Shard(0)`` on the expert mesh's "ep" dim
  (:func:`moe_parallel.apply_expert_parallel`; tokens travel to their experts' ranks and back);
- ``train.compile`` (and ``parallel.async_tp``, whose fusion happens in compiled graphs):
  every decoder, vision and MTP block ``torch.compile``-d in place
  (:mod:`qwen35_trainer.parallel.compile`); with async TP the TP plan's projections are
  async-tp-linear's fusable ``TPLinear`` and Inductor's micro-pipeline TP is enabled on the TP
  mesh (:func:`async_tp_linear.enable_async_tp`, CUDA / NCCL only);
- activation checkpointing of decoder and vision blocks;
- PP (``pp > 1``): the model keeps this rank's pipeline stages only (before anything above),
  and each stage is sharded by FSDP2 below as its own root and run by torch's schedule
  (:mod:`qwen35_trainer.model.pipeline.build`);
- FSDP2 (:func:`fsdp_compat.shard_model`): dense parameters sharded over ``dp_shard × cp`` and
  replicated over ``dp_replicate`` (HSDP), experts over the expert mesh's ``efsdp`` (and
  ``dp_replicate``), the units being the decoder layers and vision blocks, named explicitly;
  with ``train.dtype: bfloat16`` FSDP2 casts what trains for the compute and gathers what is
  frozen as stored (a LoRA run's base is stored in the compute dtype, or FP8, which a cast
  would turn into bf16 bytes), and one LoRA process is not wrapped at all (its unsharded
  copies would only duplicate the base; the adapters cast themselves);
  or, with ``parallel.fsdp_backend: megatron``, megatron-fsdp over ``dp_shard × cp`` with the
  same units and SUM reductions (HSDP over ``dp_replicate``), the meta model materialised one
  unit at a time as it shards (:mod:`qwen35_trainer.parallel.megatron`: what differs and how
  the step stays the same).

The gradient rule (the one scaling in the trainer): each rank's loss is its SHARE of the global
batch's loss (:mod:`qwen35_trainer.model.objective`) and every gradient reduction is a SUM
(``grad_reduction="sum"``), so the reduced gradient is the sum of the shares' gradients: the
one-process gradient. Why each reduction sums exactly the right contributions:

- a dense parameter's local gradient is its share's; FSDP sums over the ``batch`` ranks
  (``dp_replicate × dp_shard × cp``, every rank holding different tokens); TP peers hold the
  same tokens and are not in that group: a TP-sharded weight's local gradient is its slice of
  the full one, a TP-replicated weight's is complete on every peer (the column-parallel input's
  backward all-reduces over "tp"), the per-head norms are summed by their DTensor;
- a routed expert's gradient on its owner already sums the contributions of the EP group's
  tokens (the dispatch's backward returns them), and FSDP sums over the expert replicas
  (``dp_replicate × efsdp``): together every ``batch`` rank's tokens, each once;
- under sequence parallelism the TP peers hold different tokens inside the SP regions: a
  parameter there that TP does not split (norms, routers, shared-expert gates, routed experts)
  has a partial local gradient, and the rule is ONE all-reduce over "tp" of exactly those
  gradients after the backward (:func:`~qwen35_trainer.parallel.sequence_parallel.
  sum_sequence_parallel_grads`, called by the step before clipping; FSDP's shards of them are the
  same on every TP peer); everything outside the regions (embedding, final norm, ``lm_head``,
  vision tower, MTP ``fc`` and norms) again sees whole rows on every TP peer;
- gradient accumulation adds micro-batches' shares of the SAME global loss, so it is exact.

This rank's :class:`Layout` — which tokens it holds and which groups its collectives use — is
read from mesh coordinates, never computed from the global rank, so no rank order is assumed:
``data_group`` of ``data_groups`` (which data-parallel group's rows it takes); under CP the ranks
of ``cp_group`` share one packed row; ``loss_group``: every rank holding different tokens
(``dp_replicate × dp_shard × cp``; TP peers hold the same tokens and are left out so nothing is
counted twice), over which the valid-label count, the aux-loss statistics and the logged totals
are summed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import async_tp_linear
from async_tp_linear import enable_async_tp, swap_tp_linears
from fsdp_compat import MixedPrecision, shard_model, shard_modules
from moe_parallel import (
    apply_activation_checkpointing,
    apply_expert_parallel,
    apply_tensor_parallel,
)
from qwen35_trainer.parallel.compile import compile_blocks
from qwen35_trainer.parallel.dims import ROW_UNIT, MeshAxis, Meshes, ParallelDims
from qwen35_trainer.parallel.dist import init_distributed, world
from qwen35_trainer.parallel.layout_checks import validate_layout
from qwen35_trainer.parallel.megatron import shard_megatron
from qwen35_trainer.parallel.sequence_parallel import (
    SequenceParallelGrads,
    apply_sequence_parallel,
    region_parameters,
)
from qwen35_trainer.parallel.tp_gdn import split_gated_deltanet
from qwen35_trainer.parallel.tp_lora import split_adapters
from qwen35_trainer.parallel.tp_plan import held_entries, tp_linears, tp_plan

__all__ = [
    "FSDP_UNITS",
    "Layout",
    "apply_parallelism",
    "check_tp_heads",
    "gated_deltanet_layers",
    "parallelize",
    "validate_layout",
]

# The blocks FSDP shards as units (each all-gathered just before it runs).
FSDP_UNITS = ("Qwen3_5MoeDecoderLayer", "Qwen3_5MoeVisionBlock")


@dataclasses.dataclass
class Layout:
    """Where this rank sits (one process: the defaults)."""

    data_group: int = 0
    data_groups: int = 1
    loss_group: Any = None
    cp: int = 1
    cp_group: Any = None
    meshes: Meshes | None = None

    @property
    def row_multiple(self) -> int:
        """What this run's packed rows are padded to a multiple of
        (:attr:`ParallelDims.row_multiple`)."""
        return ROW_UNIT if self.meshes is None else self.meshes.dims.row_multiple

    @property
    def pipelined(self) -> bool:
        """Under PP every micro-batch's row is padded to its whole capacity (the stages'
        buffers have one shape, :mod:`qwen35_trainer.parallel.pipeline`)."""
        return self.meshes is not None and self.meshes.dims.pp > 1

    @classmethod
    def from_meshes(cls, meshes: Meshes) -> Layout:
        dims = meshes.dims
        return cls(
            data_group=meshes.data_group(),
            data_groups=dims.data_groups,
            loss_group=meshes.batch.get_group() if dims.batch > 1 else None,
            cp=dims.cp,
            cp_group=meshes.cp.get_group() if dims.cp > 1 else None,
            meshes=meshes,
        )


def parallelize(
    objective: torch.nn.Module,
    recipe: Any,
    device: torch.device,
    *,
    dims: ParallelDims | None = None,
    filler: Callable[[], Callable[[torch.nn.Module], None]] | None = None,
    pipeline: Callable[[int], Callable] | None = None,
) -> Layout:
    """Build the meshes of ``recipe``'s layout on the default process group (``dims``: the
    layout when already validated) and apply TP, EP, activation checkpointing and FSDP2 (bf16
    compute with ``train.dtype: bfloat16``) to ``objective`` in place; this rank's
    :class:`Layout`. ``filler()``: a function filling one materialised module's own
    parameters (:func:`qwen35_trainer.model.build.module_filler`), which megatron-fsdp
    (``parallel.fsdp_backend: megatron``) calls as it materialises and shards the model.
    ``pipeline(pp_rank)``: under ``parallel.pp > 1``, keeps the stages of that pipeline rank
    and returns their builder (:func:`qwen35_trainer.model.pipeline.build.plan_pipeline`)."""
    init_distributed()  # one process without a group: its one-rank group (see .dist)
    dims = dims or validate_layout(recipe, world())
    meshes = dims.build(device.type)
    stages = None
    if meshes.pp is not None:  # this rank keeps its stages' modules only
        if pipeline is None:
            raise ValueError("parallel.pp > 1: parallelize needs the model's pipeline stages")
        stages = pipeline(meshes.pp.get_local_rank())
    bf16 = recipe.train.dtype == "bfloat16"
    lora = recipe.model.lora is not None
    apply_parallelism(
        objective,
        meshes,
        activation_checkpointing=recipe.train.activation_checkpointing,
        param_dtype=torch.bfloat16 if bf16 else None,
        # one LoRA process: no FSDP, whose unsharded copies would only duplicate the base
        fsdp=not (lora and dims.world == 1),
        sequence_parallel=dims.sp,
        # async TP only where it can run (validate_layout refused it elsewhere; the planner
        # builds GPU layouts on a fake CPU world, where the TP linears are the same parameters)
        async_tp=recipe.parallel.async_tp and async_tp_linear.async_tp_refusal(device.type) is None,
        compile_blocks_too=recipe.train.compile,
        fsdp_backend=recipe.parallel.fsdp_backend,
        filler=filler,
        device=device,
        pipeline=stages,
    )
    return Layout.from_meshes(meshes)


def gated_deltanet_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformers Gated DeltaNet layers (the decoder's linear-attention mixers)."""
    return [m for m in model.modules() if type(m).__name__ == "Qwen3_5MoeGatedDeltaNet"]


def check_tp_heads(text_config, tp: int) -> None:
    """``ValueError`` unless ``tp`` splits the attention heads whole."""
    heads = {
        "num_attention_heads": text_config.num_attention_heads,
        "num_key_value_heads": text_config.num_key_value_heads,
    }
    bad = {k: v for k, v in heads.items() if v % tp}
    if bad:
        raise ValueError(
            f"parallel.tp={tp} must divide the attention head counts so each rank holds whole "
            f"heads; model.text has {bad}"
        )
    if text_config.shared_expert_intermediate_size % tp:
        raise ValueError(
            f"parallel.tp={tp} must divide model.text.shared_expert_intermediate_size="
            f"{text_config.shared_expert_intermediate_size}"
        )


def _frozen(param: torch.nn.Parameter) -> bool:
    return not param.requires_grad


def _shard_stage(shard: Callable, stage: torch.nn.Module, **options: Any) -> None:
    """FSDP2 on one pipeline stage, its units those of :data:`FSDP_UNITS` it holds
    (``options``: FSDP's, e.g. ``reshard_after_forward``)."""
    held = {type(m).__name__ for m in stage.modules()}
    shard(stage, unit_modules=[unit for unit in FSDP_UNITS if unit in held], **options)


def apply_parallelism(
    objective: torch.nn.Module,
    meshes: Meshes,
    *,
    activation_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
    sequence_parallel: bool = False,
    async_tp: bool = False,
    compile_blocks_too: bool = False,
    fsdp_backend: str = "fsdp2",
    filler: Callable[[], Callable[[torch.nn.Module], None]] | None = None,
    device: torch.device | None = None,
    fsdp: bool = True,
    pipeline: Callable | None = None,
) -> None:
    """TP (``sequence_parallel``: with SP), EP, activation checkpointing, then FSDP2 (or
    megatron-fsdp, ``fsdp_backend="megatron"``: materialised on ``device`` with
    ``filler()``, :func:`qwen35_trainer.parallel.megatron.shard_megatron`), in
    place, on ``meshes``; ``fsdp=False`` leaves the parameters unsharded (one LoRA process; only
    the modules it trains in full are wrapped, each its own unit, when they must be cast for
    a bf16 compute). ``pipeline(shard, pp_mesh, device)``: builds this rank's pipeline stages
    (:func:`qwen35_trainer.model.pipeline.build.build_pipeline`), each sharded by ``shard`` (FSDP2,
    its own root) and run by torch's schedule: ``objective.pipeline``.

    ``param_dtype``: FSDP2's compute dtype (bf16) for what trains, with fp32 sharded (master)
    parameters and fp32 gradient reduction; frozen parameters are gathered and computed as
    stored; ``None`` computes in the parameters' dtype."""
    dims, model = meshes.dims, objective.model
    # the modules a LoRA run trains in full (model.lora.train_modules), before wrappers rename;
    # not lm_head, whose weight the loss reads outside its forward (the objective casts it)
    # under PP this rank's stages' only: another stage's module is absent or holds nothing here
    modules = dict(model.named_modules())
    trained = [
        modules[name]
        for name in getattr(model, "lora_trained", ())
        if name != "lm_head" and next(modules.get(name, nn.Module()).parameters(), None) is not None
    ]
    sp = sequence_parallel and dims.tp > 1
    if dims.tp > 1:
        check_tp_heads(model.config.text_config, dims.tp)
        # torch's SequenceParallel style re-creates the q/k norms' parameters trainable: a
        # frozen (LoRA) weight must stay frozen
        frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        plan = tp_plan(model, sequence_parallel=sp)
        if pipeline is not None:  # this stage's layers only
            plan = held_entries(model, plan)
        if async_tp:  # the projections in the shape Inductor's micro-pipeline TP pass fuses
            swap_tp_linears(model, tp_linears(plan))
            enable_async_tp(meshes.tp, sequence_parallel=sp)
        apply_tensor_parallel(model, meshes.tp, plan)
        for layer in gated_deltanet_layers(model):
            split_gated_deltanet(layer, meshes.tp, sequence_parallel=sp)
        split_adapters(model, meshes.tp)  # LoRA: each adapter split with its projection
        for name, param in model.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
    if dims.ep > 1:
        apply_expert_parallel(model, meshes.ep)
    if sp:  # found before FSDP puts every parameter on a mesh; read back when summed
        objective.sequence_parallel = SequenceParallelGrads(
            region_parameters(model), meshes.tp.get_group()
        )
    if compile_blocks_too or async_tp:  # the async-TP fusion happens in compiled graphs
        compile_blocks(model, tp_split=dims.tp > 1)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if sp:
        apply_sequence_parallel(model, meshes.tp.get_group())
        objective.router.sequence_group = meshes.tp.get_group()
        objective.router.aux_group = meshes.routing.get_group()
    if fsdp_backend == "megatron":  # validate_layout refused what it does not run
        if filler is None:
            raise ValueError(
                "parallel.fsdp_backend=megatron materialises the model as it shards it: the "
                "planner and other meta-only builds plan FSDP2 (parallel.fsdp_backend=fsdp2)"
            )
        shard_megatron(objective, meshes, device, FSDP_UNITS, filler, param_dtype)
        return
    mp = None
    if param_dtype is not None:
        # what is frozen is gathered as stored: in the compute dtype already (a LoRA run's base,
        # store_frozen), or FP8, which a cast would turn into bf16 bytes
        mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32, keep_dtype=_frozen)
    shard = functools.partial(
        shard_model,
        mesh=meshes.dense,
        shard_dims=(MeshAxis.DP_SHARD, MeshAxis.CP),
        replicate_dims=(MeshAxis.DP_REPLICATE,) if dims.dp_replicate > 1 else (),
        unit_modules=list(FSDP_UNITS),
        mixed_precision=mp,
        expert_mesh=meshes.expert_fsdp if dims.ep > 1 else None,
        grad_reduction="sum",
    )
    if pipeline is not None:
        objective.pipeline = pipeline(functools.partial(_shard_stage, shard), meshes.pp, device)
        return
    if not fsdp:  # one LoRA process: only the modules it trains in full need casting
        if mp is not None and trained:
            shard_modules(trained, meshes.dense, shard_dims=(MeshAxis.DP_SHARD, MeshAxis.CP),
                          mixed_precision=mp, grad_reduction="sum")  # fmt: skip
        return
    shard(objective)
