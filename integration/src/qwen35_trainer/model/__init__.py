"""The model stage: transformers' Qwen3.5 MoE-VLM with this workspace's MoE blocks, built on
the meta device and materialised shard by shard (:mod:`.build`, :mod:`.init`, :mod:`.shards`,
:mod:`.params`), HF checkpoints read straight into shards through one state-dict adapter
(:mod:`.adapter`, :mod:`.load`) and exported without gathering (:mod:`.export`); the forwards
packing and CP change (:mod:`.packed`), the training objective (:mod:`.objective`), the FLOP
model (:mod:`.flops`), and the one way a run builds it (:func:`build_training_model`)."""

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
