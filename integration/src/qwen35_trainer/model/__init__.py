"""The model stage: transformers' Qwen3.5 MoE-VLM with this workspace's MoE blocks, built on
the meta device (:mod:`.build`, :mod:`.config`, :mod:`.params`) and materialised shard by shard
from its weight sources — the seeded initialisation, a checkpoint folder, an adapter folder —
judged against the whole model however pipeline stages split it (:mod:`.weights`,
:mod:`.whole`), and exported without gathering (:mod:`.weights.export`); LoRA (:mod:`.lora`),
the frozen base in FP8 (:mod:`.fp8`), the multi-token-prediction head (:mod:`.mtp`), pipeline
stages (:mod:`.pipeline`), the forwards packing and CP change (:mod:`.packed`), the training
objective (:mod:`.objective`), the FLOP model (:mod:`.flops`), the kernels (:mod:`.kernels`),
and the one way a run builds it (:func:`build_training_model`)."""

from qwen35_trainer.model.build import (
    build_meta_model,
    build_model,
    init_parameters,
    materialize,
    moe_blocks,
)
from qwen35_trainer.model.config import build_config, check_shapes
from qwen35_trainer.model.objective import LossShares, TrainingObjective
from qwen35_trainer.model.packed import enable_packing
from qwen35_trainer.model.training import build_training_model
from qwen35_trainer.model.weights.export import export_hf
from qwen35_trainer.model.weights.load import load_hf_weights

__all__ = [
    "LossShares",
    "TrainingObjective",
    "build_config",
    "build_meta_model",
    "build_model",
    "build_training_model",
    "check_shapes",
    "enable_packing",
    "export_hf",
    "init_parameters",
    "load_hf_weights",
    "materialize",
    "moe_blocks",
]
