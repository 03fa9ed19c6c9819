"""What a layout refuses, before any collective: :func:`validate_layout` gathers every reason
(the degrees, the model they must split, packing, LoRA, megatron-fsdp, the pipeline, this
machine) into one message."""

from __future__ import annotations

from typing import Any

from qwen35_trainer.parallel.dims import ParallelDims
from qwen35_trainer.parallel.megatron import megatron_refusals
from qwen35_trainer.parallel.pipeline_split import pipeline_refusals
from qwen35_trainer.parallel.requirements import machine_refusals

__all__ = ["lora_refusals", "model_refusals", "validate_layout"]


def model_refusals(parallel: Any, text_config: Any) -> list[str]:
    """Why the degrees of ``parallel`` cannot split the model of ``text_config``: TP must
    divide the attention and Gated DeltaNet head counts and the shared expert's width, EP the
    routed experts."""
    tp, ep, text = parallel.tp, parallel.ep, text_config
    split = {
        "num_attention_heads": (text.num_attention_heads, tp),
        "num_key_value_heads": (text.num_key_value_heads, tp),
        "linear_num_key_heads": (text.linear_num_key_heads, tp),
        "linear_num_value_heads": (text.linear_num_value_heads, tp),
        "shared_expert_intermediate_size": (text.shared_expert_intermediate_size, tp),
        "num_experts": (text.num_experts, ep),
    }
    return [
        f"parallel.{'ep' if key == 'num_experts' else 'tp'}={degree} must divide "
        f"model.text.{key}={size}"
        for key, (size, degree) in split.items()
        if size % degree
    ]


def lora_refusals(recipe: Any) -> list[str]:
    """Why ``model.lora`` cannot train with the recipe's layout (empty: it can, or no LoRA).
    The layouts refused are those not yet proven against one process with adapters (with a
    base held in FP8: TP too)."""
    if recipe.model.lora is None:
        return []
    p, reasons = recipe.parallel, []
    if p.async_tp:
        reasons.append(
            "model.lora with parallel.async_tp is not built yet: async TP swaps the projections "
            "for its fusable linear, which has no adapter; set parallel.async_tp: false"
        )
    if p.fsdp_backend == "megatron":
        reasons.append(
            "model.lora with parallel.fsdp_backend=megatron is not built yet: megatron-fsdp "
            "holds frozen and trained parameters in one buffer; use parallel.fsdp_backend=fsdp2"
        )
    if recipe.model.fp8_base and p.tp > 1:
        reasons.append(
            "a frozen base held in FP8 (model.base_dtype=fp8, or LoRA on an FP8 checkpoint) "
            "with parallel.tp > 1 is not built yet: TP would split each FP8 weight and its "
            "block scales together (the Gated DeltaNet's fused in_proj_qkv by its heads' rows, "
            "which need not fall on block boundaries); use parallel.tp=1 (EP, CP and FSDP "
            "shard the FP8 base)"
        )
    return reasons


def validate_layout(
    recipe: Any, world_size: int, *, on_this_machine: bool = True, config: Any = None
) -> ParallelDims:
    """The run's :class:`ParallelDims` from the recipe's ``parallel`` section, or ``ValueError``
    with every reason it cannot run in ``world_size`` ranks (``on_this_machine``: and on this
    machine, :func:`~qwen35_trainer.parallel.requirements.machine_refusals`; the planner plans
    GPU runs anywhere; ``config``: the model's, and the degrees must split it,
    :func:`model_refusals`)."""
    parallel, packing = recipe.parallel, recipe.data.packing
    reasons = [] if config is None else model_refusals(parallel, config.text_config)
    try:
        dims = ParallelDims.from_recipe(parallel, world_size)
    except ValueError as err:
        reasons.append(str(err).removeprefix("invalid parallel layout: "))
        dims = None
    if parallel.cp > 1 and not packing:
        reasons.append(
            "parallel.cp > 1 needs data.packing: context parallelism splits ONE packed row "
            "over the CP ranks by its document layout"
        )
    if recipe.model.mtp_depth and not packing:
        reasons.append(
            f"model.mtp_layers={recipe.model.mtp_depth} needs data.packing: the "
            "multi-token-prediction head reads each document's next tokens from the packed "
            "row's layout (or set model.mtp_layers: 0)"
        )
    if parallel.tp > 1 and not packing:
        reasons.append(
            "parallel.tp > 1 needs data.packing: the TP-split Gated DeltaNet layers run "
            "cp-varlen-attn's packed forward on this rank's heads"
        )
    length = recipe.data.pack_length
    split = dims is not None and (parallel.sp or parallel.pp > 1)
    if split and packing and length is not None and length % dims.row_multiple:
        under = "sequence parallelism" if parallel.sp else "parallel.pp > 1"
        reasons.append(
            f"data.pack_length={length} must be a multiple of {dims.row_multiple} under {under} "
            f"(8 and cp x tp = {parallel.cp * parallel.tp}: the CP and TP ranks hold equal "
            "slices of every row, ParallelDims.row_multiple)"
        )
    reasons += megatron_refusals(recipe) + lora_refusals(recipe)
    reasons += pipeline_refusals(recipe, None if config is None else config.text_config)
    if on_this_machine:
        reasons += machine_refusals(parallel)
    if reasons:
        raise ValueError("invalid parallel layout: " + "; ".join(reasons))
    return dims
