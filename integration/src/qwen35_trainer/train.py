"""The training loop: one process, or any ``(dp_replicate, dp, cp, tp, ep)`` layout.

Why the ranks take the same step as one process on the global batch: every rank builds the same
initial weights (seeded), takes its tokens of the step's global batch (its data-parallel
group's rows, and under CP its pieces of the packed row; TP peers take the same) and
backpropagates its SHARE of the global loss (:mod:`qwen35_trainer.objective`); every gradient
reduction is a SUM (:mod:`qwen35_trainer.parallel.apply`), so the reduced gradient is the
gradient of the global loss. The valid labels of ALL the step's micro-batches are counted once
before the first forward (one all-reduce), so with ``train.grad_accum_steps`` the micro-batches'
shares add up to the same loss. Clipping uses the norm of the full gradients over every mesh,
the same number on every rank (:func:`fsdp_compat.clip_grad_norm`), and the optimizer
(:func:`safe_optim.build_optimizer`, safe with empty local shards) updates each shard as the
single process updates the whole tensor.

``train.dtype: bfloat16``: FSDP2 mixed precision (bf16 parameters and compute, fp32 sharded
master weights, fp32 reduction). One process then runs the same FSDP2 code on a one-rank
process group made here (and destroyed at the end), so one process and every layout round
alike.

The logged loss is the sum of the shares over the loss group (one all-reduce), i.e. the global
batch's loss, identical on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdp_compat import clip_grad_norm
from qwen35_trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from qwen35_trainer.data import IGNORE_INDEX, collate, rank_samples
from qwen35_trainer.hf import export_hf
from qwen35_trainer.model import build_model
from qwen35_trainer.objective import TrainingObjective
from qwen35_trainer.packing import PackedInputs, enable_packing, pack, row_layout
from qwen35_trainer.parallel import Layout, check_layout, parallelize
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
    """The step logs and the trained objective (its parameters are DTensor shards when
    distributed)."""

    logs: list[StepLog]
    objective: TrainingObjective


def _device() -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init_distributed(one_rank_group: bool) -> bool:
    """Create the process group under torchrun, or a one-rank group when asked; returns
    whether it was made here for one process (to destroy at the end)."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend)
        return False
    if not one_rank_group:
        return False
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def train(recipe: Recipe, *, on_step: Callable[[StepLog], None] | None = None) -> TrainResult:
    """Run ``recipe.train.steps`` optimizer steps, streaming each step's log to ``on_step``.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) the process group is created here unless it exists.
    """
    bf16 = recipe.train.dtype == "bfloat16"
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_layout(recipe.parallel, world, packing=recipe.data.packing)
    own_group = _init_distributed(one_rank_group=bf16)
    try:
        return _train(recipe, on_step, bf16)
    finally:
        if own_group:
            dist.destroy_process_group()


def _train(recipe: Recipe, on_step, bf16: bool) -> TrainResult:
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
        param_dtype=torch.bfloat16 if bf16 else None,
        force_fsdp=bf16,
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
    coef = recipe.train.router_aux_loss_coef
    coef = model.config.text_config.router_aux_loss_coef if coef is None else coef
    logs = []
    for step in range(start, recipe.train.steps):
        began = time.perf_counter()
        micro = _micro_batches(recipe, model, layout, step, device)
        num_valid = _count_valid(micro, layout, device)
        ce = aux = torch.zeros((), device=device)
        for batch, packed in micro:
            shares = objective(batch, layout.loss_group, packed, num_valid_tokens=num_valid)
            micro_aux = shares.aux / len(micro)
            (shares.ce + coef * micro_aux).backward()
            ce, aux = ce + shares.ce.detach(), aux + micro_aux.detach()
        grad_norm = clip_grad_norm(objective.parameters(), recipe.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        totals = torch.stack([ce, aux]).float()
        if layout.loss_group is not None:
            dist.all_reduce(totals, group=layout.loss_group)
        ce_total, aux_total = totals.tolist()
        log = StepLog(step + 1, ce_total + coef * aux_total, ce_total, aux_total, grad_norm,
                      num_valid, time.perf_counter() - began)  # fmt: skip
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


def _micro_batches(recipe: Recipe, model, layout: Layout, step: int, device: torch.device):
    """This rank's ``(batch, packed inputs or None)`` per micro-batch of step ``step``."""
    samples = rank_samples(recipe.model, recipe.data, step, layout.data_index, layout.data_size)
    n = recipe.train.grad_accum_steps
    if len(samples) % n:
        raise ValueError(
            f"data.samples_per_rank={len(samples)} must be a multiple of "
            f"train.grad_accum_steps={n} (each micro-batch takes the same number of samples)"
        )
    pad = model.config.text_config.pad_token_id
    size = len(samples) // n
    out = []
    for first in range(0, len(samples), size):
        part = samples[first : first + size]
        if recipe.data.packing:
            row = pack(part, recipe.model, model.model.get_rope_index, pad)
            packed = PackedInputs(row.position_ids.to(device), row_layout(row, layout.cp),
                                  layout.cp_group)  # fmt: skip
            out.append((row.batch.to(device), packed))
        else:
            out.append((collate(part, recipe.model, pad).to(device), None))
    return out


def _count_valid(micro, layout: Layout, device: torch.device) -> int:
    """The step's valid next-token labels over every micro-batch and every data group. CP
    ranks share their rows, so each counts its whole rows and the sum is divided by ``cp``."""
    local = sum(int((batch.labels[:, 1:] != IGNORE_INDEX).sum()) for batch, _ in micro)
    if layout.loss_group is None:
        return local
    total = torch.tensor([local], device=device)
    dist.all_reduce(total, group=layout.loss_group)
    return int(total) // layout.cp


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
