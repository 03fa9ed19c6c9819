"""The training loop: one process, or any ``(dp_replicate, dp, cp, tp, ep)`` layout.

Why the ranks take the same step as one process on the global batch: the model is built on the
meta device, parallelised, then each rank materialises its shards of the same initial weights
(name-seeded, or read from ``model.weights``; :mod:`qwen35_trainer.model.build`), takes its tokens of the step's global batch (its data-parallel
group's rows, and under CP its pieces of the packed row; TP peers take the same) and
backpropagates its SHARE of the global loss (:mod:`qwen35_trainer.model.objective`); every gradient
reduction is a SUM (:mod:`qwen35_trainer.parallel.apply`), so the reduced gradient is the
gradient of the global loss. The valid labels of ALL the step's micro-batches are counted once
before the first forward (one all-reduce), so with ``train.grad_accum_steps`` the micro-batches'
shares add up to the same loss. Clipping uses the norm of the full gradients over every mesh,
the same number on every rank (:func:`fsdp_compat.clip_grad_norm`), and the optimizer
(:func:`safe_optim.build_optimizer`, safe with empty local shards) updates each shard as the
single process updates the whole tensor.

One process is the same program: it runs on a one-rank process group made here (kept for the
life of the process, so the returned model's DTensor parameters stay usable), through the same
meshes and FSDP2 wrapping as any layout. ``train.dtype: bfloat16``: FSDP2 mixed precision (bf16
parameters and compute, fp32 sharded master weights, fp32 reduction), so one process and
every layout round alike (megatron-fsdp: bf16 weights over fp32 main weights and gradients,
:mod:`qwen35_trainer.parallel.megatron`).

The logged loss is the sum of the shares over the loss group (one all-reduce), i.e. the global
batch's loss, identical on every rank. The loop is made of units a test or a user can drive:
the step (:func:`qwen35_trainer.train.step.train_step`), the schedule
(:func:`qwen35_trainer.train.schedule.lr_at`, re-applied every step, so a resumed run follows the
recipe it is started with), the run folder (:mod:`qwen35_trainer.supervise.run_folder`) and the
checkpoints (:mod:`qwen35_trainer.train.checkpoint`, :mod:`qwen35_trainer.train.resume`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_compat import full_tensor
from qwen35_trainer.data.feed import Feed
from qwen35_trainer.model import build_config, build_training_model
from qwen35_trainer.model.flops import peak_flops
from qwen35_trainer.model.kernels import resolve_kernels
from qwen35_trainer.model.loss import total_loss
from qwen35_trainer.model.objective import TrainingObjective
from qwen35_trainer.parallel import Layout, ParallelDims, validate_layout
from qwen35_trainer.parallel.dist import all_ranks, init_distributed, rank, world
from qwen35_trainer.parallel.dist import device as this_device
from qwen35_trainer.parallel.megatron import place_distributed, wire_optimizer
from qwen35_trainer.parallel.resources import RunResources, open_run
from qwen35_trainer.recipe import Recipe
from qwen35_trainer.recipe.hub import check_same_commits, hub_commits
from qwen35_trainer.supervise.console import what_runs
from qwen35_trainer.supervise.metrics import StepLog, peak_memory_mib
from qwen35_trainer.supervise.preemption import Preempted, StopFlag
from qwen35_trainer.supervise.run_folder import RunFolder, resolved_recipe
from qwen35_trainer.supervise.watchdog import Watchdog
from qwen35_trainer.train.checkpoint import AsyncCheckpointer, data_state_files, save_checkpoint
from qwen35_trainer.train.determinism import deterministic_mode, prepare_cuda
from qwen35_trainer.train.eval import evaluate
from qwen35_trainer.train.export import ExportOptions, check_export_dir, export_model
from qwen35_trainer.train.nonfinite import NonFiniteGuard, NonFiniteStep
from qwen35_trainer.train.pipeline_step import step_function
from qwen35_trainer.train.resume import changed_on_resume, restore_data_state, resume_point
from qwen35_trainer.train.schedule import lr_at, optimizer_name, set_lr
from safe_optim import build_optimizer

__all__ = ["Setup", "StepLog", "TrainResult", "setup", "start_processes", "train"]

logger = logging.getLogger("qwen35_trainer")


@dataclasses.dataclass
class TrainResult:
    """The step logs, the trained objective (its parameters are DTensors: shards on this
    rank's meshes, whole on one process's one-rank group) and its optimizer (with this rank's
    state). The run's process groups live until :meth:`close` (or the end of a ``with``
    block; dropped unclosed, the next run in this process releases them:
    :mod:`qwen35_trainer.parallel.resources`)."""

    logs: list[StepLog]
    objective: TrainingObjective
    optimizer: torch.optim.Optimizer | None = None
    resources: RunResources | None = None

    def __post_init__(self) -> None:
        if self.resources is not None:  # the run stays open while the caller holds this
            self.resources.result = weakref.ref(self)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's state as plain, whole tensors (each DTensor shard gathered; under
        a launch every rank must call it), in transformers' names."""
        if self.objective is None or (self.resources is not None and self.resources.released):
            raise RuntimeError(
                "this TrainResult was closed: its model's shards went with the run's process "
                "groups; read state_dict() before closing it"
            )
        with torch.no_grad():  # values, not a graph that would keep the model alive
            return {
                name: full_tensor(value)
                for name, value in self.objective.model.state_dict().items()
            }

    def close(self) -> None:
        """Release the run's process groups and its model's hold on them (every rank); the
        result keeps its logs only (a model kept would keep the groups' backends)."""
        if self.resources is not None:
            self.resources.release()
        self.objective = self.optimizer = None

    def __enter__(self) -> TrainResult:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def train(recipe: Recipe, *, on_step: Callable[[StepLog], None] | None = None) -> TrainResult:
    """Run ``recipe.train.steps`` optimizer steps, streaming each step's log to ``on_step``.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) the process group is created here unless it exists.
    What the run creates is released when it fails, when its result is closed
    (:class:`TrainResult`), or, the result dropped unclosed, when the next run starts; a
    :class:`NonFiniteStep` carries the run's result, open, for inspection.
    """
    resources = open_run()
    try:
        dims = start_processes(recipe)
        with deterministic_mode(recipe.train.deterministic):
            return _train(recipe, on_step, dims, resources)
    except NonFiniteStep:
        raise
    except BaseException:
        resources.release()
        raise


def check_run(recipe: Recipe, world_size: int) -> ParallelDims:
    """The recipe's layout on ``world_size`` ranks, or ``ValueError`` with every reason it
    cannot run (the layout, the model it must split, this machine) or a named kernel that
    cannot; no collective. The built-in launcher runs it before it starts any worker, so a
    refusal is one message from one process; every worker runs it again."""
    training = recipe.train
    if training.checkpoint_every and not (training.checkpoint_dir or training.output_dir):
        raise ValueError(
            f"train.checkpoint_every={training.checkpoint_every} but neither "
            "train.checkpoint_dir nor train.output_dir says where checkpoints go (qwen35-train "
            "gives a run folder by default; train() does not)"
        )
    dims = validate_layout(recipe, world_size, config=build_config(recipe.model))
    resolve_kernels(recipe, "cuda" if torch.cuda.is_available() else "cpu")
    return dims


def start_processes(recipe: Recipe) -> ParallelDims:
    """The recipe's layout, checked against the launch before any collective
    (:func:`check_run`), and the process group: torchrun's, or a one-rank group for one
    process."""
    launched = world() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    dims = check_run(recipe, launched)
    prepare_cuda(recipe.train.deterministic)
    init_distributed()
    return dims


@dataclasses.dataclass
class Setup:
    """What a run trains, on this rank: the objective (the model parallelised and materialised),
    its optimizer, where this rank sits, its device, the aux-loss coefficient and the MTP
    loss weight (0 without the head)."""

    objective: TrainingObjective
    optimizer: torch.optim.Optimizer
    layout: Layout
    device: torch.device
    aux_coef: float
    mtp_weight: float = 0.0

    def loss_weights(self) -> dict[str, float]:
        """The keyword arguments :func:`train_step` and :func:`evaluate` weigh the loss with."""
        return {"aux_coef": self.aux_coef, "mtp_weight": self.mtp_weight}


def setup(recipe: Recipe, dims: ParallelDims | None = None) -> Setup:
    """The recipe's model as every run trains it on this rank
    (:func:`qwen35_trainer.model.build_training_model`) and its optimizer, after
    :func:`start_processes` (``dims``: what it returned)."""
    device = this_device()
    check_same_commits(all_ranks(hub_commits(recipe)))  # every rank reads the same inputs
    objective, layout = build_training_model(recipe, device, dims=dims)
    model, training = objective.model, recipe.train
    optimizer = build_optimizer(
        [p for p in objective.parameters() if p.requires_grad],  # LoRA: the adapters only
        optimizer_name(training.optimizer),
        lr=training.lr,
        betas=training.betas,
        eps=training.eps,
        weight_decay=training.weight_decay,
    )
    wire_optimizer(objective, optimizer)  # megatron-fsdp: its sync and weight install
    coef = training.router_aux_loss_coef
    coef = model.config.text_config.router_aux_loss_coef if coef is None else coef
    mtp_weight = training.mtp_loss_weight if objective.mtp_depth else 0.0
    return Setup(objective, optimizer, layout, device, coef, mtp_weight)


def _train(recipe: Recipe, on_step, dims: ParallelDims, resources: RunResources) -> TrainResult:
    if recipe.train.export_dir:  # refused now, not after the run
        check_export_dir(recipe.train.export_dir, recipe.train.export_overwrite)
    training = recipe.train
    with Watchdog(training.hang_timeout, training.output_dir, rank(), world()) as watchdog:
        return _watched(recipe, on_step, dims, resources, watchdog)


def _watched(recipe, on_step, dims, resources, watchdog: Watchdog) -> TrainResult:
    """The run, each phase reported to ``watchdog``."""
    run = setup(recipe, dims)
    resources.hold(run.objective, run.objective.router.clear)
    objective, optimizer, layout, device = run.objective, run.optimizer, run.layout, run.device
    model, training = objective.model, recipe.train
    if training.prewarm:
        from setup_prewarm import prewarm

        report = prewarm(objective, device=device)
        logger.info("prewarm:\n%s", report.table())
    kernels = resolve_kernels(recipe, device.type)
    folder = None
    if training.output_dir:
        folder = RunFolder(training.output_dir, recipe, rank(), kernels=kernels.record())
    for line in what_runs(recipe, world(), device, kernels, model):
        logger.info(line)
        if folder is not None:
            folder.note(line)
    for warning in kernels.fallbacks:
        logger.warning(warning)
        if folder is not None:
            folder.note(warning)
    checkpoints = training.checkpoint_root
    start, damaged = resume_point(checkpoints, objective, optimizer, training.verify_checkpoints)
    for message in damaged:
        logger.warning(message)
        if folder is not None:
            folder.note(message)
    feed = Feed(recipe, model.config, layout, device)
    if start:
        restore_data_state(feed, Path(checkpoints) / f"step_{start:06d}")
        messages = [f"resumed from step {start} of {checkpoints}"]
        messages += changed_on_resume(Path(checkpoints) / f"step_{start:06d}", recipe)
        for message in messages:
            logger.info(message)
            if folder is not None:
                folder.note(message)
    logs = []
    stop = StopFlag()
    try:
        with stop.installed():
            for log in _steps(run, recipe, feed, checkpoints, start, stop, watchdog.beat):
                logs.append(log)
                if folder is not None:
                    folder.record(log)
                if on_step is not None:
                    on_step(log)
    except NonFiniteStep as failed:
        failed.result = TrainResult(logs, objective, optimizer, resources)
        raise
    except Preempted as stopped:
        if folder is not None:  # what a requeue script reads (docs/scaling.md)
            folder.note(str(stopped))
        raise
    finally:
        if folder is not None:
            folder.close()
    place_distributed(objective)  # megatron-fsdp after an evaluation: the trained shards
    if training.export_dir:
        watchdog.beat(len(logs) + start, "export")
        options = ExportOptions(
            overwrite=training.export_overwrite,
            lora=training.export_format if recipe.model.lora is not None else None,
        )
        pipeline = objective.pipeline.group if objective.pipeline is not None else None
        exported = export_model(objective.model, recipe, training.export_dir, options, pipeline)
        for note in exported:
            logger.info("export %s: %s", training.export_dir, note)
    return TrainResult(logs, objective, optimizer, resources)


def _steps(
    run: Setup,
    recipe: Recipe,
    feed: Feed,
    checkpoints: str | None,
    start: int,
    stop: StopFlag,
    beat: Callable[[int, str], None],
) -> Iterator[StepLog]:
    """Steps ``start`` .. ``train.steps``, each one's log yielded once it is taken; checkpoints
    as the recipe asks; stops (saving) after a step when any rank got a preemption signal, and
    raises :class:`NonFiniteStep` after yielding a non-finite step's log when the recipe says
    stop. With ``train.async_checkpoint`` a checkpoint is completed by the next one, or before
    the loop returns or stops."""
    objective, optimizer, layout, device = run.objective, run.optimizer, run.layout, run.device
    training = recipe.train
    peak = peak_flops(device)
    ranks = world()
    writer = AsyncCheckpointer() if checkpoints and training.async_checkpoint else None
    guard = NonFiniteGuard(training.on_nonfinite, training.max_skipped_steps)
    for step in range(start, training.steps):
        began = time.perf_counter()
        lr = lr_at(step, training)
        set_lr(optimizer, lr)
        beat(step + 1, "reading the step's data")
        micro, data = feed.step(step)
        beat(step + 1, "forward, backward and optimizer step")
        result = step_function(objective)(
            objective,
            optimizer,
            micro,
            layout,
            grad_clip=training.grad_clip,
            device=device,
            **run.loss_weights(),
        )
        seconds = time.perf_counter() - began
        loss = total_loss(result.ce, result.aux, result.mtp, **run.loss_weights())
        failed = guard.check(step + 1, loss, result, data.sources)
        eval_every, held_out = training.eval_every, None
        if (
            not failed
            and eval_every
            and ((step + 1) % eval_every == 0 or step + 1 == training.steps)
        ):
            beat(step + 1, "held-out evaluation")
            held_out = evaluate(
                recipe, objective, layout, feed.eval_batches(), device=device, **run.loss_weights()
            )
        log = StepLog(
            step + 1,
            loss,
            result.ce,
            result.aux,
            result.grad_norm,
            result.tokens,
            seconds,
            lr=lr,
            eval_loss=held_out.loss if held_out else None,
            eval_accuracy=held_out.accuracy if held_out else None,
            mtp_loss=result.mtp or None,
            eval_mtp_accuracy=held_out.mtp_accuracy if held_out else None,
            data_seconds=data.seconds,
            fill=data.fill,
            over_capacity=data.over_capacity,
            bad_rows=data.bad_rows,
            peak_memory_mib=peak_memory_mib(device),
            expert_load_max_over_mean=result.expert_load_max_over_mean,
            experts_idle=result.experts_idle,
            cp_imbalance=result.cp_imbalance,
            mfu=result.flops / (seconds * ranks * peak) if peak and seconds > 0 else None,
            skipped_steps=guard.skipped,
        )
        yield log
        if failed:
            if writer is not None:
                writer.wait()  # the checkpoint being written completes: it stays the newest
            raise failed
        every = training.checkpoint_every
        beat(step + 1, "agreeing whether to stop (one all-reduce)")
        stopping = stop.agreed(device)
        due = step + 1 == training.steps or (every and (step + 1) % every == 0)
        if checkpoints and (due or stopping):
            beat(step + 1, "saving the checkpoint")
            save_checkpoint(
                checkpoints,
                step + 1,
                objective,
                optimizer,
                keep=training.keep_checkpoints,
                files={"recipe.yaml": resolved_recipe(recipe), **data_state_files(feed)},
                background=writer,
            )
        if stopping and writer is not None:
            beat(step + 1, "completing the background checkpoint")
            writer.wait()
        if stopping:
            where = f"{checkpoints}/step_{step + 1:06d}" if checkpoints else None
            logger.info("stopping on a signal after step %d (saved: %s)", step + 1, where)
            raise Preempted(step + 1, where)
    if writer is not None:
        writer.wait()
