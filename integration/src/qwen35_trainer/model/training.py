"""The model as every run trains it: ONE function the trainer, the planner, the export command
and the tests build it with, so they run the same lines."""

from __future__ import annotations

import functools
from typing import Any

import torch

from qwen35_trainer.model import build
from qwen35_trainer.model.lora.adapters import store_frozen
from qwen35_trainer.model.objective import TrainingObjective
from qwen35_trainer.model.pipeline.build import plan_pipeline
from qwen35_trainer.parallel import Layout, ParallelDims, parallelize

__all__ = ["build_training_model"]


def build_training_model(
    recipe: Any, device: torch.device, *, materialize: bool = True, dims: ParallelDims | None = None
) -> tuple[TrainingObjective, Layout]:
    """``(objective, layout)``: the recipe's model built on the meta device (adapted to packed
    rows with ``data.packing``), wrapped in its :class:`TrainingObjective`, parallelised on the
    recipe's meshes (:func:`qwen35_trainer.parallel.parallelize`; ``dims``: the layout when
    already validated) and — unless ``materialize`` is false (the planner) — this rank's
    shards allocated on ``device`` and filled: name-seeded, or read from ``model.path`` /
    ``model.weights`` (megatron-fsdp: one unit at a time while it shards,
    :mod:`qwen35_trainer.parallel.megatron`). Every rank of the default process group calls
    it."""
    model = build.build_meta_model(recipe.model, packing=recipe.data.packing)
    if recipe.model.lora is not None and recipe.train.dtype == "bfloat16":
        store_frozen(model, torch.bfloat16)  # the frozen base in bf16: no master copy needed
    objective = TrainingObjective(model, loss_chunk_size=recipe.train.loss_chunk_size)
    fill = build.fill_settings(recipe.model, recipe.train.seed)
    # FSDP2 shards the meta model, then each rank fills its shards; megatron-fsdp fills each
    # unit's whole modules itself, module by module, as it shards them
    layout = parallelize(
        objective,
        recipe,
        device,
        dims=dims,
        filler=(lambda: build.module_filler(model, device, **fill)) if materialize else None,
        pipeline=functools.partial(plan_pipeline, recipe, objective),
    )
    if materialize and objective.megatron is None:
        build.materialize(model, device, **fill)
    return objective, layout
