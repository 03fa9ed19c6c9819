"""Apply a run's parallelism to the model, in the repository's fixed order: TP, EP, AC, FSDP.

Every mesh comes from :class:`~qwen35_trainer.parallel.dims.ParallelDims`; this module only
places the model on them:

- TP (``tp > 1``): :data:`~qwen35_trainer.parallel.tp_plan.TP_PLAN` on the dense mesh's "tp"
  dim — attention heads and the shared expert split, routed experts and routers never — and
  every Gated DeltaNet layer split by heads (:mod:`qwen35_trainer.parallel.tp_gdn`);
- EP (``ep > 1``): every MoE's routed experts ``Shard(0)`` on the expert mesh's "ep" dim
  (:func:`moe_parallel.apply_expert_parallel`; tokens travel to their experts' ranks and back);
- activation checkpointing of decoder and vision blocks;
- FSDP2 (:func:`fsdp_compat.shard_model`): dense parameters sharded over ``dp_shard × cp`` and
  replicated over ``dp_replicate`` (HSDP), experts over the expert mesh's ``efsdp`` (and
  ``dp_replicate``), the units being the decoder layers and vision blocks, named explicitly.

The gradient rule (the one scaling in the trainer): each rank's loss is its SHARE of the global
batch's loss (:mod:`qwen35_trainer.objective`) and every gradient reduction is a SUM
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
- gradient accumulation adds micro-batches' shares of the SAME global loss, so it is exact.
"""

from __future__ import annotations

import torch

from fsdp_compat import MixedPrecision, shard_model
from moe_parallel import (
    apply_activation_checkpointing,
    apply_expert_parallel,
    apply_tensor_parallel,
)
from qwen35_trainer.parallel.dims import Meshes
from qwen35_trainer.parallel.tp_gdn import split_gated_deltanet
from qwen35_trainer.parallel.tp_plan import TP_PLAN

__all__ = ["FSDP_UNITS", "apply_parallelism", "check_tp_heads", "gated_deltanet_layers"]

# The blocks FSDP shards as units (each all-gathered just before it runs).
FSDP_UNITS = ("Qwen3_5MoeDecoderLayer", "Qwen3_5MoeVisionBlock")


def gated_deltanet_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformers Gated DeltaNet layers (the decoder's linear-attention mixers)."""
    return [m for m in model.modules() if type(m).__name__ == "Qwen3_5MoeGatedDeltaNet"]


def check_tp_heads(text_config, tp: int) -> None:
    """``ValueError`` unless ``tp`` splits the attention heads whole."""
    heads = {"num_attention_heads": text_config.num_attention_heads,
             "num_key_value_heads": text_config.num_key_value_heads}  # fmt: skip
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


def apply_parallelism(
    objective: torch.nn.Module,
    meshes: Meshes,
    *,
    activation_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
) -> None:
    """TP, EP, activation checkpointing, then FSDP2, in place, on ``meshes``.

    ``param_dtype``: FSDP2's compute dtype (bf16), with fp32 sharded (master) parameters and
    fp32 gradient reduction; ``None`` computes in the parameters' dtype."""
    dims, model = meshes.dims, objective.model
    if dims.tp > 1:
        check_tp_heads(model.config.text_config, dims.tp)
        apply_tensor_parallel(model, meshes.tp, TP_PLAN)
        for layer in gated_deltanet_layers(model):
            split_gated_deltanet(layer, meshes.tp)
    if dims.ep > 1:
        apply_expert_parallel(model, meshes.ep)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    mp = None
    if param_dtype is not None:
        mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32)
    shard_model(
        objective,
        meshes.dense,
        shard_dims=("dp_shard", "cp"),
        replicate_dims=("dp_replicate",) if dims.dp_replicate > 1 else (),
        unit_modules=list(FSDP_UNITS),
        mixed_precision=mp,
        expert_mesh=meshes.expert_fsdp if dims.ep > 1 else None,
        grad_reduction="sum",
    )
