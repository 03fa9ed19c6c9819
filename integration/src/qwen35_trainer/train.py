"""The training loop: one process, or ``dp x cp`` ranks (FSDP2, optionally EP or CP).

Why the ranks take the same step as one process on the global batch: every rank builds the same
initial weights (seeded), takes its tokens of the step's global batch (its DP group's rows, and
under CP its pieces of the packed row), and computes its SHARE of the global loss
(:mod:`qwen35_trainer.objective`); the gradient of the global loss is the SUM of the shares'
gradients. FSDP2 reduce-scatters the MEAN over all ``world`` ranks, so each rank backpropagates
``world * share`` (the layouts and their gradient factors: :mod:`qwen35_trainer.parallelize`).
Clipping uses the norm of the full (DTensor) gradients, the same number on every rank
(:mod:`qwen35_trainer.grad_norm`), and the optimizer (:func:`safe_optim.build_optimizer`, safe
with empty local shards) updates each shard as the single process updates the whole tensor.

The logged loss is the sum of the shares over ranks (one all-reduce), i.e. the global batch's
loss, identical on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from qwen35_trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from qwen35_trainer.data import collate, rank_samples
from qwen35_trainer.grad_norm import clip_grad_norm
from qwen35_trainer.hf import export_hf
from qwen35_trainer.model import build_model
from qwen35_trainer.objective import TrainingObjective
from qwen35_trainer.packing import PackedInputs, enable_packing, pack, row_layout
from qwen35_trainer.parallelize import check_layout, parallelize
from qwen35_trainer.recipe import Recipe
from safe_optim import build_optimizer

__all__ = ["StepLog", "TrainResult", "train"]


@dataclasses.dataclass(frozen=True)
class StepLog:
    """What one optimizer step did (global numbers, equal on every rank)."""

    step: int
    loss: float
    ce: float
    aux: float
    grad_norm: float
    tokens: int
    seconds: float


@dataclasses.dataclass
class TrainResult:
    """The step logs and the trained objective (its parameters are DTensor shards when dp > 1)."""

    logs: list[StepLog]
    objective: TrainingObjective


def _device() -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init_distributed() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def train(recipe: Recipe, *, on_step: Callable[[StepLog], None] | None = None) -> TrainResult:
    """Run ``recipe.train.steps`` optimizer steps, streaming each step's log to ``on_step``.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) the process group is created here unless it exists.
    """
    dp = recipe.parallel.dp
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_layout(recipe.parallel, world, packing=recipe.data.packing)
    _init_distributed()
    device = _device()
    model = build_model(recipe.model, seed=recipe.train.seed).to(device)
    if recipe.data.packing:
        enable_packing(model)
    objective = TrainingObjective(model, loss_chunk_size=recipe.train.loss_chunk_size)
    layout = parallelize(
        objective,
        recipe.parallel,
        device,
        packing=recipe.data.packing,
        activation_checkpointing=recipe.train.activation_checkpointing,
    )
    optimizer = build_optimizer(
        objective.parameters(),
        recipe.train.optimizer,
        lr=recipe.train.lr,
        betas=recipe.train.betas,
        eps=recipe.train.eps,
        weight_decay=recipe.train.weight_decay,
    )
    start = _resume(recipe, objective, optimizer, device)
    text = model.config.text_config
    rope_index = model.model.get_rope_index
    coef = recipe.train.router_aux_loss_coef
    coef = text.router_aux_loss_coef if coef is None else coef
    logs = []
    for step in range(start, recipe.train.steps):
        began = time.perf_counter()
        samples = rank_samples(recipe.model, recipe.data, step, layout.data_rank, dp)
        packed = None
        if recipe.data.packing:
            row = pack(samples, recipe.model, rope_index, text.pad_token_id)
            batch = row.batch.to(device)
            packed = PackedInputs(row.position_ids.to(device), row_layout(row, layout.cp),
                                  layout.cp_group)  # fmt: skip
        else:
            batch = collate(samples, recipe.model, text.pad_token_id).to(device)
        shares = objective(batch, layout.data_group, packed)
        (layout.world * (shares.ce + coef * shares.aux)).backward()
        layout.after_backward(objective)
        grad_norm = clip_grad_norm(objective.parameters(), recipe.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        totals = torch.stack([shares.ce.detach(), shares.aux.detach()]).float()
        if layout.data_group is not None:
            dist.all_reduce(totals, group=layout.data_group)
        ce, aux = totals.tolist()
        log = StepLog(step + 1, ce + coef * aux, ce, aux, grad_norm, shares.tokens,
                      time.perf_counter() - began)  # fmt: skip
        logs.append(log)
        if on_step is not None:
            on_step(log)
        every = recipe.train.checkpoint_every
        if recipe.train.checkpoint_dir and (
            step + 1 == recipe.train.steps or (every and (step + 1) % every == 0)
        ):
            save_checkpoint(recipe.train.checkpoint_dir, step + 1, objective, optimizer)
    if recipe.train.export_dir:
        export_hf(objective.model, recipe.train.export_dir)
    return TrainResult(logs, objective)


def _resume(recipe: Recipe, objective, optimizer, device: torch.device) -> int:
    """Steps already done: 0, or those of the newest checkpoint (the same on every rank).
    ``device``: where the default group's collectives run (CUDA under NCCL)."""
    if not recipe.train.checkpoint_dir:
        return 0
    found = latest_checkpoint(recipe.train.checkpoint_dir)
    step = -1 if found is None else found[1]
    if dist.is_initialized():
        seen = torch.tensor([step, -step], device=device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        seen = seen.cpu()
        if seen[0] != -seen[1]:
            raise ValueError(
                f"ranks see different newest checkpoints under {recipe.train.checkpoint_dir} "
                f"(steps {int(-seen[1])}..{int(seen[0])}, -1 = none): it must be one shared "
                "directory"
            )
    if found is None:
        return 0
    return load_checkpoint(found[0], objective, optimizer)
