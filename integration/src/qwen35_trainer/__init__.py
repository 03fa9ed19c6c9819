"""Long-context trainer for Qwen3.5 MoE-VLM models, assembled from this workspace's packages.

Today: transformers' Qwen3.5 MoE-VLM with :class:`moe_parallel.MoE` blocks, a synthetic
multimodal data stream, the global-batch loss (:mod:`chunked_loss` cross-entropy + router aux
loss), data parallelism with FSDP2 (:mod:`fsdp_compat`), :mod:`safe_optim` optimizers, YAML
recipes and the ``qwen35-train`` CLI.
"""

from qwen35_trainer.data import Batch, global_batch, rank_batch
from qwen35_trainer.model import build_config, build_model, moe_blocks, swap_moe_blocks
from qwen35_trainer.objective import LossShares, TrainingObjective
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

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "DataRecipe",
    "LossShares",
    "ModelRecipe",
    "ParallelRecipe",
    "Recipe",
    "StepLog",
    "TrainRecipe",
    "TrainResult",
    "TrainingObjective",
    "__version__",
    "build_config",
    "build_model",
    "global_batch",
    "load_recipe",
    "moe_blocks",
    "rank_batch",
    "recipe_from_dict",
    "swap_moe_blocks",
    "train",
]
