"""Long-context trainer for Qwen3.5 MoE-VLM models, assembled from this workspace's packages.

transformers' Qwen3.5 MoE-VLM with :class:`moe_parallel.MoE` blocks; the global-batch loss
(:mod:`chunked_loss` cross-entropy + router aux loss); FSDP2 (:mod:`fsdp_compat`) with EP, TP,
CP and packing (:mod:`cp_varlen_attn`, :mod:`cp_vision`); activation checkpointing;
:mod:`safe_optim` optimizers; DCP checkpoints that prove their integrity; a transformers
checkpoint directory as the source of truth, exported back; multi-turn image / video
conversations through the checkpoint's processor and chat template (a seeded synthetic stream
without a dataset); YAML recipes, a planner and the ``qwen35-train`` CLI.

The stages, one folder each, data flowing one way: :mod:`.recipe` → :mod:`.parallel` →
:mod:`.data` → :mod:`.model` → :mod:`.train` and :mod:`.plan` → :mod:`.cli`.
"""

from moe_parallel import swap_moe_blocks
from qwen35_trainer.data import Batch, global_batch, rank_batch
from qwen35_trainer.data.packing import PackedInputs, pack
from qwen35_trainer.model import (
    LossShares,
    TrainingObjective,
    build_config,
    build_meta_model,
    build_model,
    build_training_model,
    enable_packing,
    export_hf,
    load_hf_weights,
    materialize,
    moe_blocks,
)
from qwen35_trainer.parallel import TP_PLAN, Layout, ParallelDims, parallelize, validate_layout
from qwen35_trainer.recipe import (
    DataRecipe,
    ModelRecipe,
    ParallelRecipe,
    Recipe,
    TrainRecipe,
    load_recipe,
    recipe_from_dict,
)
from qwen35_trainer.train import StepLog, TrainResult, train

__version__ = "0.2.0"

__all__ = [
    "TP_PLAN",
    "Batch",
    "DataRecipe",
    "Layout",
    "LossShares",
    "ModelRecipe",
    "PackedInputs",
    "ParallelDims",
    "ParallelRecipe",
    "Recipe",
    "StepLog",
    "TrainRecipe",
    "TrainResult",
    "TrainingObjective",
    "__version__",
    "build_config",
    "build_meta_model",
    "build_model",
    "build_training_model",
    "enable_packing",
    "export_hf",
    "global_batch",
    "load_hf_weights",
    "load_recipe",
    "materialize",
    "moe_blocks",
    "pack",
    "parallelize",
    "rank_batch",
    "recipe_from_dict",
    "swap_moe_blocks",
    "train",
    "validate_layout",
]
