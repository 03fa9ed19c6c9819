"""A process that runs many trainings keeps no thread and no process group of the ones that
ended (:mod:`qwen35_trainer.parallel.resources`): the check runs, one after another on the same
ranks (or in one process), a run closed through ``with``, one that fails midway, one dropped
unclosed (the next run releases it), a replay and an export, and compares the thread count and
the live process groups with those before them."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from dist_checks import layout_recipe

from qwen35_trainer import train
from qwen35_trainer.parallel.resources import live_groups
from qwen35_trainer.train.export import export_checkpoint
from qwen35_trainer.train.replay import replay


def _counts() -> tuple[int, int]:
    """(threads of this process, live process groups), after a collection."""
    gc.collect()
    return len(os.listdir("/proc/self/task")), len(live_groups())


class _Stop(Exception):
    pass


def _fail(log) -> None:
    raise _Stop(f"stopped by the caller after step {log.step}")


def check_runs_release_what_they_create(folder: str, *overrides: str) -> list[tuple[int, int]]:
    """Every run below leaves the counts as they were before it; returns them, in order."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    saved = Path(folder) / "checkpoints"
    short = (*overrides, "train.steps=1")  # what the runs below leave is the point, not steps
    recipe = layout_recipe(
        world,
        *overrides,
        "train.steps=2",
        f"train.checkpoint_dir={saved}",
        "train.checkpoint_every=1",
        "train.async_checkpoint=true",
        "train.eval_every=2",
    )
    with train(recipe):  # the first run starts what a process starts once (autograd's threads)
        pass
    counts = [_counts()]
    with train(layout_recipe(world, *short)) as result:
        result.state_dict()
    counts.append(_counts())
    with pytest.raises(_Stop):
        train(layout_recipe(world, *short), on_step=_fail)
    counts.append(_counts())
    train(layout_recipe(world, *short))  # dropped unclosed: the next run releases it
    with train(layout_recipe(world, *short)):
        pass
    counts.append(_counts())
    replay(recipe, saved, 2)
    counts.append(_counts())
    export_checkpoint(recipe, saved / "step_000002", Path(folder) / "export")
    counts.append(_counts())
    assert len(counts) == 6 and len(set(counts)) == 1, counts
    return counts
