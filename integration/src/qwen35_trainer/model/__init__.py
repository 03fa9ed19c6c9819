"""The model stage: transformers' Qwen3.5 MoE-VLM with this workspace's MoE blocks, built on
the meta device and materialised shard by shard (:mod:`.build`, :mod:`.init`, :mod:`.shards`),
HF checkpoints read straight into shards through one state-dict adapter (:mod:`.adapter`,
:mod:`.load`) and exported without gathering (:mod:`.export`)."""

from qwen35_trainer.model.build import (
    build_meta_model,
    build_model,
    init_parameters,
    materialize,
    moe_blocks,
)
from qwen35_trainer.model.config import build_config, check_shapes
from qwen35_trainer.model.export import export_hf
from qwen35_trainer.model.load import load_hf_weights

__all__ = [
    "build_config",
    "build_meta_model",
    "build_model",
    "check_shapes",
    "export_hf",
    "init_parameters",
    "load_hf_weights",
    "materialize",
    "moe_blocks",
]
