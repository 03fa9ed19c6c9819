"""The training loop: one process, or any ``(dp_replicate, dp, cp, tp, ep)`` layout.

Why the ranks take the same step as one process on the global batch: the model is built on the
meta device, parallelised, then each rank materialises its shards of the same initial weights
(name-seeded, or read from ``model.weights``; :mod:`qwen35_trainer.model.build`), takes its tokens of the step's global batch (its data-parallel
group's rows, and under CP its pieces of the packed row; TP peers take the same) and
backpropagates its SHARE of the global loss (:mod:`qwen35_trainer.objective`); every gradient
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
every layout round alike.

The logged loss is the sum of the shares over the loss group (one all-reduce), i.e. the global
batch's loss, identical on every rank. The loop is made of units a test or a user can drive:
the step (:func:`qwen35_trainer.step.train_step`), the schedule
(:func:`qwen35_trainer.schedule.lr_at`, re-applied every step, so a resumed run follows the
recipe it is started with), the run folder (:mod:`qwen35_trainer.run_folder`) and the
checkpoints (:mod:`qwen35_trainer.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from qwen35_trainer.checkpoint import (
    AsyncCheckpointer,
    load_checkpoint,
    newest_loadable,
    save_checkpoint,
)
from qwen35_trainer.data.feed import Feed
from qwen35_trainer.data.packing import enable_packing
from qwen35_trainer.determinism import deterministic_mode, prepare_cuda
from qwen35_trainer.flops import peak_flops
from qwen35_trainer.model import build_meta_model, export_hf, materialize
from qwen35_trainer.nonfinite import NonFiniteGuard, NonFiniteStep
from qwen35_trainer.objective import TrainingObjective
from qwen35_trainer.parallel import Layout, check_layout, parallelize
from qwen35_trainer.preemption import Preempted, StopFlag
from qwen35_trainer.recipe import Recipe
from qwen35_trainer.run_folder import RunFolder, resolved_recipe
from qwen35_trainer.schedule import lr_at, set_lr
from qwen35_trainer.step import evaluate, peak_memory_mib, train_step
from safe_optim import build_optimizer

__all__ = ["Setup", "StepLog", "TrainResult", "setup", "start_processes", "train"]

logger = logging.getLogger("qwen35_trainer")


@dataclasses.dataclass(frozen=True)
class StepLog:
    """What one optimizer step did (global numbers, equal on every rank). ``seconds``: the
    step's wall time, ``data_seconds`` of it spent building its batches; ``peak_memory_mib``:
    this rank's peak so far (CUDA allocator, or RSS on CPU); the expert load is over every
    layer's routed assignments of the step's row tokens (padding included); ``mfu``: the step's
    model FLOPs (:mod:`qwen35_trainer.flops`) over its time and every rank's peak FLOP/s
    (``None`` where the peak is unknown, e.g. on CPU); ``eval_accuracy``: the held-out labels'
    next-token accuracy; with a dataset (:mod:`qwen35_trainer.data.loader`): ``data_seconds``
    is the time the step waited for its rows, ``fill`` the share of the rows' capacity holding
    document tokens, ``over_capacity`` the documents longer than ``data.pack_length``
    (truncated or dropped) and ``bad_rows`` the rows skipped under ``data.on_bad_row: skip``,
    both in this step; ``skipped_steps``: the steps of this run not applied so far
    (non-finite, ``train.on_nonfinite: skip``; :mod:`qwen35_trainer.nonfinite`)."""

    step: int
    loss: float
    ce: float
    aux: float
    grad_norm: float
    tokens: int
    seconds: float
    lr: float = 0.0
    eval_loss: float | None = None
    data_seconds: float = 0.0
    peak_memory_mib: float = 0.0
    expert_load_max_over_mean: float = 1.0
    experts_idle: int = 0
    cp_imbalance: float = 1.0
    mfu: float | None = None
    eval_accuracy: float | None = None
    fill: float | None = None
    over_capacity: int = 0
    bad_rows: int = 0
    skipped_steps: int = 0

    def metrics(self) -> dict:
        """The ``metrics.jsonl`` record (:data:`qwen35_trainer.run_folder.METRIC_FIELDS`); a
        non-finite number is ``null`` (JSON has none)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["step_seconds"] = out.pop("seconds")
        out["tokens_per_s"] = self.tokens / self.seconds if self.seconds > 0 else None
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in out.items()}  # fmt: skip


@dataclasses.dataclass
class TrainResult:
    """The step logs, the trained objective (its parameters are DTensors: shards on this
    rank's meshes, whole on one process's one-rank group) and its optimizer (with this rank's
    state)."""

    logs: list[StepLog]
    objective: TrainingObjective
    optimizer: torch.optim.Optimizer | None = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's state as plain, whole tensors (each DTensor shard gathered; under
        a launch every rank must call it), in transformers' names."""
        return {name: value.full_tensor() if hasattr(value, "full_tensor") else value
                for name, value in self.objective.model.state_dict().items()}  # fmt: skip


def _device() -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init_distributed() -> None:
    """Create the process group under torchrun, or a one-rank group for one process. The
    one-rank group stays for the life of the process (the trained model's parameters are
    DTensors on it, usable after ``train`` returns; a later ``train`` reuses it)."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None:
            dist.init_process_group(backend)
            return
        # Restarted workers share the elastic agent's store with the attempt before them, whose
        # keys (a rank's address, under the same group names) are still there: each attempt
        # gets its own key prefix, so no worker reads a dead worker's address.
        store, rank, world = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"qwen35_trainer/attempt_{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        return
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def train(recipe: Recipe, *, on_step: Callable[[StepLog], None] | None = None) -> TrainResult:
    """Run ``recipe.train.steps`` optimizer steps, streaming each step's log to ``on_step``.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) the process group is created here unless it exists.
    """
    start_processes(recipe)
    with deterministic_mode(recipe.train.deterministic):
        return _train(recipe, on_step)


def start_processes(recipe: Recipe) -> None:
    """Check the layout against the launch (before any collective) and create the process
    group: torchrun's, or a one-rank group for one process."""
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_layout(recipe.parallel, world, packing=recipe.data.packing)
    prepare_cuda(recipe.train.deterministic)
    _init_distributed()


@dataclasses.dataclass
class Setup:
    """What a run trains, on this rank: the objective (the model parallelised and materialised),
    its optimizer, where this rank sits, its device and the aux-loss coefficient."""

    objective: TrainingObjective
    optimizer: torch.optim.Optimizer
    layout: Layout
    device: torch.device
    aux_coef: float


def setup(recipe: Recipe) -> Setup:
    """Build the recipe's model on meta, parallelise it, materialise this rank's shards (name-
    seeded, or ``model.weights``) and make its optimizer (after :func:`start_processes`)."""
    device = _device()
    model = build_meta_model(recipe.model)
    if recipe.data.packing:
        enable_packing(model)
    spec = recipe.train
    objective = TrainingObjective(model, loss_chunk_size=spec.loss_chunk_size)
    layout = parallelize(
        objective,
        recipe.parallel,
        device,
        packing=recipe.data.packing,
        activation_checkpointing=spec.activation_checkpointing,
        param_dtype=torch.bfloat16 if spec.dtype == "bfloat16" else None,
        force_fsdp=True,
    )
    materialize(model, device, seed=spec.seed, weights=recipe.model.weights_dir)
    optimizer = build_optimizer(objective.parameters(), optimizer_name(spec.optimizer), lr=spec.lr,
                                betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)  # fmt: skip
    coef = spec.router_aux_loss_coef
    coef = model.config.text_config.router_aux_loss_coef if coef is None else coef
    return Setup(objective, optimizer, layout, device, coef)


def _train(recipe: Recipe, on_step) -> TrainResult:
    run = setup(recipe)
    objective, optimizer, layout, device = run.objective, run.optimizer, run.layout, run.device
    model, spec, coef = objective.model, recipe.train, run.aux_coef
    if spec.prewarm:
        from setup_prewarm import prewarm

        report = prewarm(objective, device=device)
        logger.info("prewarm:\n%s", report.table())
    rank = dist.get_rank() if dist.is_initialized() else 0
    folder = RunFolder(spec.output_dir, recipe, rank) if spec.output_dir else None
    checkpoints = spec.checkpoint_dir
    if checkpoints is None and spec.output_dir and spec.checkpoint_every:
        checkpoints = os.path.join(spec.output_dir, "checkpoints")
    start, damaged = _resume(checkpoints, objective, optimizer, spec.verify_checkpoints)
    for message in damaged:
        logger.warning(message)
        if folder is not None:
            folder.note(message)
    feed = Feed(recipe, model, layout, device)
    if start:
        feed.restore(Path(checkpoints) / f"step_{start:06d}")
        messages = [f"resumed from step {start} of {checkpoints}"]
        messages += _changed_on_resume(Path(checkpoints) / f"step_{start:06d}", recipe)
        for message in messages:
            logger.info(message)
            if folder is not None:
                folder.note(message)
    logs = []
    stop = StopFlag()
    try:
        with stop.installed():
            _loop(recipe, objective, optimizer, layout, feed, folder, checkpoints, start, coef,
                  device, on_step, logs, stop)  # fmt: skip
    except NonFiniteStep as failed:
        failed.result = TrainResult(logs, objective, optimizer)
        raise
    finally:
        if folder is not None:
            folder.close()
    if spec.export_dir:
        export_hf(objective.model, spec.export_dir)
    return TrainResult(logs, objective, optimizer)


def _loop(recipe, objective, optimizer, layout, feed, folder, checkpoints, start, coef, device,
          on_step, logs, stop) -> None:  # fmt: skip
    """Steps ``start`` .. ``train.steps``; checkpoints as the recipe asks; stops (saving) after
    a step when any rank got a preemption signal. With ``train.async_checkpoint`` a
    checkpoint is completed by the next one, or before the loop returns or stops."""
    spec, model = recipe.train, objective.model
    peak = peak_flops(device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    writer = AsyncCheckpointer() if checkpoints and spec.async_checkpoint else None
    save = save_checkpoint if writer is None else writer.save
    guard = NonFiniteGuard(spec.on_nonfinite, spec.max_skipped_steps)
    for step in range(start, spec.steps):
        began = time.perf_counter()
        lr = lr_at(step, spec)
        set_lr(optimizer, lr)
        micro, data = feed.step(step)
        result = train_step(objective, optimizer, micro, layout, aux_coef=coef,
                            grad_clip=spec.grad_clip, device=device)  # fmt: skip
        seconds = time.perf_counter() - began
        loss = result.ce + coef * result.aux
        failed = guard.check(step + 1, loss, result, data.sources)
        eval_every, held_out = spec.eval_every, None
        if not failed and eval_every and ((step + 1) % eval_every == 0 or step + 1 == spec.steps):
            held_out = evaluate(recipe, objective, model, layout, aux_coef=coef, device=device,
                                batches=feed.eval_batches())  # fmt: skip
        log = StepLog(
            step + 1, loss, result.ce, result.aux,
            result.grad_norm, result.tokens, seconds, lr=lr,
            eval_loss=held_out.loss if held_out else None,
            eval_accuracy=held_out.accuracy if held_out else None,
            data_seconds=data.seconds, fill=data.fill, over_capacity=data.over_capacity,
            bad_rows=data.bad_rows, peak_memory_mib=peak_memory_mib(device),
            expert_load_max_over_mean=result.expert_load_max_over_mean,
            experts_idle=result.experts_idle, cp_imbalance=result.cp_imbalance,
            mfu=result.flops / (seconds * world * peak) if peak and seconds > 0 else None,
            skipped_steps=guard.skipped,
        )  # fmt: skip
        logs.append(log)
        if folder is not None:
            folder.record(log.metrics())
        if on_step is not None:
            on_step(log)
        if failed:
            if writer is not None:
                writer.wait()  # the checkpoint being written completes: it stays the newest
            raise failed
        every = spec.checkpoint_every
        stopping = stop.agreed(device)
        due = step + 1 == spec.steps or (every and (step + 1) % every == 0)
        if checkpoints and (due or stopping):
            save(checkpoints, step + 1, objective, optimizer, keep=spec.keep_checkpoints,
                 files={"recipe.yaml": resolved_recipe(recipe), **feed.state_file()})  # fmt: skip
        if stopping and writer is not None:
            writer.wait()
        if stopping:
            where = f"{checkpoints}/step_{step + 1:06d}" if checkpoints else None
            logger.info("stopping on a signal after step %d (saved: %s)", step + 1, where)
            raise Preempted(step + 1, where)
    if writer is not None:
        writer.wait()


# Recipe values that may change between a checkpoint and its resumption (re-applied from the
# recipe the run is started with, not taken from the checkpoint).
RESUMABLE_CHANGES = ("lr", "schedule", "warmup_steps", "lr_floor", "steps")


def optimizer_name(name: str) -> str:
    """``train.optimizer`` resolved: ``auto`` is TransformerEngine's fused Adam (AdamW-style
    decay, fp32 moments) where TE imports, else torch's AdamW (said once)."""
    if name != "auto":
        return name
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        logger.info("train.optimizer=auto: TransformerEngine is not installed, using adamw")
        return "adamw"
    return "te_fused_adam"


def _changed_on_resume(path: Path, recipe: Recipe) -> list[str]:
    """One line per :data:`RESUMABLE_CHANGES` value that differs from the checkpoint's recipe."""
    saved = path / "recipe.yaml"
    if not saved.is_file():
        return []
    before = yaml.safe_load(saved.read_text()).get("train", {})
    now = dataclasses.asdict(recipe.train)
    return [f"train.{k} changed on resume: {before[k]!r} -> {now[k]!r} (the new value applies)"
            for k in RESUMABLE_CHANGES if k in before and before[k] != now[k]]  # fmt: skip


def _resume(checkpoints: str | None, objective, optimizer, checksums: bool):
    """``(steps already done, messages)``: 0, or those of the newest loadable checkpoint under
    ``checkpoints`` (the same on every rank; newer damaged ones skipped, each with a warning
    among the messages)."""
    if not checkpoints:
        return 0, []
    path, warnings = newest_loadable(checkpoints, checksums=checksums)
    if path is None:
        return 0, warnings
    return load_checkpoint(path, objective, optimizer, verified=True), warnings
