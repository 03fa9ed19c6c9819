"""A training checkpoint as a transformers checkpoint directory (``qwen35-train export``).

``checkpoint`` is one ``step_NNNNNN`` directory (verified against its manifest: a damaged one is
an error) or a checkpoint directory (its newest intact checkpoint is taken). The recipe gives the
model; its layout does not matter: the weights are re-sharded by DCP onto this launch (one
process, or FSDP over every rank under ``torchrun``, each holding 1/N), then written without
gathering (:func:`qwen35_trainer.model.export_hf`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from qwen35_trainer.model import build_training_model, export_hf
from qwen35_trainer.parallel.dist import device, init_distributed, world
from qwen35_trainer.recipe import ParallelRecipe, Recipe
from qwen35_trainer.train.checkpoint import checkpoints_in, load_model_weights, newest_loadable
from qwen35_trainer.train.integrity import MANIFEST

__all__ = ["export_checkpoint", "resolve_checkpoint"]

logger = logging.getLogger("qwen35_trainer")


def resolve_checkpoint(path: Path) -> Path:
    """The newest loadable checkpoint when ``path`` holds ``step_NNNNNN`` directories (newer
    damaged ones skipped, each logged at WARNING), else ``path`` itself (verified when it is
    loaded); ``ValueError`` when it is neither."""
    if not checkpoints_in(path):
        if not any((path / name).exists() for name in (".metadata", MANIFEST)):
            raise ValueError(f"{path}: neither a checkpoint nor a directory holding one")
        return path
    found, damaged = newest_loadable(path)
    for message in damaged:
        logger.warning(message)
    return found


def export_checkpoint(recipe: Recipe, checkpoint: Path, out: Path) -> int:
    """Write ``checkpoint``'s model (:func:`resolve_checkpoint` already applied) to ``out``;
    returns its step. Every rank of the launch calls it."""
    init_distributed()  # torchrun's group, or one rank's
    # this launch's ranks as one FSDP group, fp32, the weights allocated (every value is then
    # read from the checkpoint)
    recipe = dataclasses.replace(
        recipe,
        model=dataclasses.replace(recipe.model, weights=None, path=None),
        parallel=ParallelRecipe(dp=world()),
        train=dataclasses.replace(recipe.train, dtype="float32", activation_checkpointing=False),
    )
    objective, _ = build_training_model(recipe, device())
    step = load_model_weights(checkpoint, objective)
    export_hf(objective.model, out)
    return step
