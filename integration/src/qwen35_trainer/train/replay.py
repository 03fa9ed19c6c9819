"""Replay one training step from a checkpoint: the first thing to do with a loss spike.

:func:`replay` rebuilds the run of a recipe (the same program as training:
:func:`qwen35_trainer.train.setup`), loads the newest checkpoint before step ``N`` (verified:
a damaged one is an error), continues the data stream from the checkpoint's cursors, runs the
steps between the checkpoint and ``N`` as training did, and then computes step ``N`` once more,
measuring every layer's gradient norm before clipping and naming the documents of its global
batch.

Why it reproduces the logged step bit for bit (with ``train.deterministic``, on the launch the
run used): the weights and optimizer state come back exactly from the checkpoint, the rows of
each step are those the run read (the data stream resumes from its saved cursors, or is a pure
function of the step), the learning rate is the schedule's for each step, and every step runs
the same code on the same numbers; evaluation, which the run may have interleaved, changes no
weight. A layout other than the run's re-shards the checkpoint and gives the same step within
the layouts' parity tolerances, not bitwise.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from qwen35_trainer.data.feed import Feed
from qwen35_trainer.model.loss import total_loss
from qwen35_trainer.parallel.resources import RunResources, open_run
from qwen35_trainer.recipe import Recipe
from qwen35_trainer.supervise.run_folder import step_records
from qwen35_trainer.train.determinism import deterministic_mode
from qwen35_trainer.train.loop import setup, start_processes
from qwen35_trainer.train.nonfinite import global_sources
from qwen35_trainer.train.pipeline_step import step_function
from qwen35_trainer.train.resume import checkpoints_in, load_checkpoint, restore_data_state
from qwen35_trainer.train.schedule import lr_at, set_lr

__all__ = ["Replay", "layer_grad_norms", "logged_record", "replay"]


@dataclasses.dataclass(frozen=True)
class Replay:
    """Step ``step`` recomputed from ``checkpoint``: its logged numbers (global), each layer's
    gradient norm before clipping, and the sources of its global batch's documents."""

    step: int
    checkpoint: Path
    loss: float
    ce: float
    aux: float
    grad_norm: float
    tokens: int
    layer_norms: dict[str, float]
    sources: list[str]

    def report(self, logged: dict | None = None) -> str:
        """The replay as text; ``logged``: the run's ``metrics.jsonl`` record of the step, to
        compare with (bit for bit)."""
        lines = [
            f"replay of step {self.step} from {self.checkpoint}",
            f"loss {self.loss!r}  ce {self.ce!r}  aux {self.aux!r}  "
            f"grad_norm {self.grad_norm!r}  tokens {self.tokens}",
        ]
        if logged is not None:
            same = all(logged.get(k) == getattr(self, k) for k in ("loss", "grad_norm", "tokens"))
            lines.append(
                f"logged: loss {logged.get('loss')!r}  grad_norm "
                f"{logged.get('grad_norm')!r}  tokens {logged.get('tokens')}  -> "
                + ("identical" if same else "DIFFERENT")
            )
        width = max(len(name) for name in self.layer_norms)
        lines.append("gradient norm per layer (before clipping):")
        lines += [f"  {name:<{width}}  {norm:.6g}" for name, norm in self.layer_norms.items()]
        lines.append(f"documents of the step's global batch ({len(self.sources)}):")
        lines += [f"  {source}" for source in self.sources]
        return "\n".join(lines)


def _layer(name: str) -> str:
    """The layer a parameter belongs to: up to a block index (``...layers.3``), else its
    module."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("layers", "blocks") and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return ".".join(parts[:-1])


def layer_grad_norms(objective) -> dict[str, float]:
    """Each layer's gradient L2 norm over its parameters' WHOLE gradients (DTensor shards
    reduced over their meshes; one collective per parameter, in the same order on every
    rank), in parameter order, named as transformers names them."""
    squares: dict[str, float] = {}
    for name, param in objective.model.named_parameters():
        if param.grad is None:
            norm = 0.0
        else:
            norm = torch.linalg.vector_norm(param.grad, dtype=torch.float32)
            norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        layer = _layer(name)
        squares[layer] = squares.get(layer, 0.0) + norm * norm
    return {layer: math.sqrt(sq) for layer, sq in squares.items()}


def _checkpoint_before(path: Path, step: int) -> Path:
    """``path`` itself (one checkpoint), or the newest checkpoint under it before ``step``."""
    found = checkpoints_in(path)
    if not found:
        return path
    before = [p for s, p in found if s < step]
    if not before:
        raise ValueError(f"{path} holds no checkpoint before step {step}")
    return before[0]


def replay(recipe: Recipe, checkpoint: str | Path, step: int) -> Replay:
    """Recompute step ``step`` (1-based) of ``recipe``'s run from ``checkpoint`` (a
    ``step_NNNNNN`` directory, or a directory of them: the newest before ``step`` is taken).
    Every rank of the run's launch calls it; the update of step ``step`` is not kept, and what
    it creates (its groups, its model) is released before it returns."""
    resources = open_run()
    try:
        start_processes(recipe)
        with deterministic_mode(recipe.train.deterministic):
            return _replay(recipe, _checkpoint_before(Path(checkpoint), step), step, resources)
    finally:
        resources.release()


def _replay(recipe: Recipe, path: Path, step: int, resources: RunResources) -> Replay:
    run = setup(recipe)
    resources.hold(run.objective, run.objective.router.clear)
    done = load_checkpoint(
        path, run.objective, run.optimizer, checksums=recipe.train.verify_checkpoints
    )
    if not done < step <= recipe.train.steps:
        raise ValueError(
            f"{path} holds the state after step {done}: it can replay steps "
            f"{done + 1}..{recipe.train.steps} of this recipe, not {step}"
        )
    feed = Feed(recipe, run.objective.model.config, run.layout, run.device)
    restore_data_state(feed, path)
    kwargs = dict(grad_clip=recipe.train.grad_clip, device=run.device, **run.loss_weights())
    norms: dict[str, float] = {}

    def measure() -> None:
        norms.update(layer_grad_norms(run.objective))

    for s in range(done, step):  # the steps between the checkpoint and ``step``, then ``step``
        set_lr(run.optimizer, lr_at(s, recipe.train))
        micro, data = feed.step(s)
        last = s + 1 == step
        result = step_function(run.objective)(
            run.objective,
            run.optimizer,
            micro,
            run.layout,
            **kwargs,
            before_clip=measure if last else None,
        )
    return Replay(
        step=step,
        checkpoint=path,
        loss=total_loss(result.ce, result.aux, result.mtp, **run.loss_weights()),
        ce=result.ce,
        aux=result.aux,
        grad_norm=result.grad_norm,
        tokens=result.tokens,
        layer_norms=norms,
        sources=global_sources(data.sources),
    )


def logged_record(checkpoint: Path, step: int) -> dict | None:
    """The run folder's ``metrics.jsonl`` record of ``step`` (the run's, by
    :func:`~qwen35_trainer.supervise.run_folder.step_records`: the last attempt's) when the
    checkpoint sits in ``<run folder>/checkpoints/``, else ``None``."""
    metrics = checkpoint.parent.parent / "metrics.jsonl"
    if not metrics.is_file():
        return None
    found = [r for r in step_records(metrics) if r["step"] == step]
    return found[0] if found else None
