"""``qwen35-train export RECIPE CHECKPOINT OUT [--set section.key=value ...]``: a training
checkpoint as a transformers checkpoint directory.

``CHECKPOINT`` is one ``step_NNNNNN`` directory (verified against its manifest: a damaged one
is an error) or a checkpoint directory (its newest intact checkpoint is taken). The recipe gives the model; its layout does not matter: the weights are
re-sharded by DCP onto this launch (one process, or FSDP over every rank under ``torchrun``,
each holding 1/N), then written without gathering (:func:`qwen35_trainer.model.export_hf`).
Exit status 0, or 2 with the reason (bad recipe, no checkpoint there, a checkpoint of another
model).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from qwen35_trainer.recipe import add_recipe_arguments, load_recipe

__all__ = ["export_main"]


def _checkpoint(path: Path) -> Path:
    """The newest loadable checkpoint when ``path`` holds ``step_NNNNNN`` directories (newer
    damaged ones skipped, each said), else ``path`` itself (verified when it is loaded)."""
    from qwen35_trainer.checkpoint import checkpoints_in, newest_loadable
    from qwen35_trainer.integrity import MANIFEST

    if not checkpoints_in(path):
        if not any((path / name).exists() for name in (".metadata", MANIFEST)):
            raise ValueError(f"{path}: neither a checkpoint nor a directory holding one")
        return path
    found, damaged = newest_loadable(path)
    for message in damaged:
        print(f"qwen35-train export: {message}", file=sys.stderr)
    return found


def _export(recipe, checkpoint: Path, out: Path) -> int:
    import torch
    import torch.distributed as dist

    from qwen35_trainer.checkpoint import load_model_weights
    from qwen35_trainer.model import build_meta_model, export_hf, materialize
    from qwen35_trainer.objective import TrainingObjective
    from qwen35_trainer.parallel import parallelize
    from qwen35_trainer.recipe import ParallelRecipe

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) \
        if torch.cuda.is_available() else torch.device("cpu")  # fmt: skip
    world = dist.get_world_size() if dist.is_initialized() else 1
    spec = dataclasses.replace(recipe.model, weights=None, path=None)
    model = build_meta_model(spec)
    objective = TrainingObjective(model)
    parallelize(objective, ParallelRecipe(dp=world), device)
    materialize(model, device)  # allocated here; every value is then read from the checkpoint
    step = load_model_weights(checkpoint, objective)
    export_hf(model, out)
    return step


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="qwen35-train export",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    add_recipe_arguments(parser, recipe_help="the recipe the checkpoint was trained with")
    parser.add_argument("checkpoint", type=Path, help="a step_NNNNNN directory or its parent")
    parser.add_argument("out", type=Path, help="the transformers checkpoint directory to write")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    made_group = False
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        checkpoint = _checkpoint(args.checkpoint)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            import torch

            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            made_group = True
        step = _export(recipe, checkpoint, args.out)
    except (OSError, ValueError) as err:
        print(f"qwen35-train export: {err}", file=sys.stderr)
        return 2
    finally:
        if made_group:
            dist.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":
        print(f"exported step {step} of {checkpoint} to {args.out}")
    return 0
