"""The training loop: one process, or ``dp`` data-parallel ranks sharded with FSDP2.

Why ``dp`` ranks take the same step as one process on the global batch: every rank builds the
same initial weights (seeded), takes its own rows of the step's global batch
(:func:`qwen35_trainer.data.rank_batch`), and computes its SHARE of the global loss
(:mod:`qwen35_trainer.objective`); the gradient of the global loss is the SUM of the shares'
gradients. FSDP2 reduce-scatters the MEAN over the shard group, so each rank backpropagates
``dp * share``. Clipping uses the norm of the full (DTensor) gradients, the same number on every
rank, and the optimizer (:func:`safe_optim.build_optimizer`, safe with empty local shards)
updates each shard as the single process updates the whole tensor.

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
from torch.distributed.device_mesh import init_device_mesh

from chunked_loss import global_num_valid_tokens
from fsdp_compat import shard_model
from qwen35_trainer.data import rank_batch
from qwen35_trainer.model import build_model
from qwen35_trainer.objective import TrainingObjective, shifted_labels
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


def _init_distributed(dp: int) -> None:
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != dp:
        raise ValueError(
            f"parallel.dp={dp} must equal the launched world size {world} (WORLD_SIZE); "
            f"launch with `torchrun --nproc-per-node {dp} ...` or set parallel.dp={world}"
        )
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def train(recipe: Recipe, *, on_step: Callable[[StepLog], None] | None = None) -> TrainResult:
    """Run ``recipe.train.steps`` optimizer steps, streaming each step's log to ``on_step``.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) the process group is created here unless it exists.
    """
    dp = recipe.parallel.dp
    _init_distributed(dp)
    device = _device()
    model = build_model(recipe.model, seed=recipe.train.seed).to(device)
    objective = TrainingObjective(model, loss_chunk_size=recipe.train.loss_chunk_size)
    group, rank = None, 0
    if dp > 1:
        mesh = init_device_mesh(device.type, (dp,), mesh_dim_names=("dp",))
        shard_model(objective, mesh, shard_dims=("dp",))
        group, rank = mesh.get_group(), mesh.get_local_rank()
    optimizer = build_optimizer(
        objective.parameters(),
        recipe.train.optimizer,
        lr=recipe.train.lr,
        betas=recipe.train.betas,
        weight_decay=recipe.train.weight_decay,
    )
    text = model.config.text_config
    coef = recipe.train.router_aux_loss_coef
    coef = text.router_aux_loss_coef if coef is None else coef
    logs = []
    for step in range(recipe.train.steps):
        start = time.perf_counter()
        batch = rank_batch(recipe.model, recipe.data, text.pad_token_id, step, rank, dp)
        batch = batch.to(device)
        tokens = global_num_valid_tokens(shifted_labels(batch), group=group)
        shares = objective(batch, tokens, group)
        (dp * (shares.ce + coef * shares.aux)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(objective.parameters(), recipe.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        totals = torch.stack([shares.ce.detach(), shares.aux.detach()]).float()
        if group is not None:
            dist.all_reduce(totals, group=group)
        ce, aux = totals.tolist()
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        log = StepLog(step + 1, ce + coef * aux, ce, aux, float(norm), int(tokens),
                      time.perf_counter() - start)  # fmt: skip
        logs.append(log)
        if on_step is not None:
            on_step(log)
    return TrainResult(logs, objective)
