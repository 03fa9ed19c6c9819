"""What a layout needs from the machine, checked before any rank builds anything.

:func:`machine_refusals` gives every reason the recipe's ``parallel`` section cannot run here —
async TP off CUDA / NCCL (async-tp-linear's own reason, :func:`async_tp_linear.async_tp_refusal`),
megatron-fsdp without CUDA or its package (and, where both are present, because the trainer does
not assemble it yet) and the combinations the trainer does not run on megatron-fsdp — so
:func:`qwen35_trainer.parallel.validate_layout` refuses the recipe in one message. Every rank of
a launch runs the same checks on the same recipe and machine, so every rank exits the same way,
before any collective.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

__all__ = ["machine_refusals"]


def machine_refusals(parallel: Any, *, cuda: bool | None = None) -> list[str]:
    """Why ``parallel`` cannot run on this machine (``cuda``: whether a CUDA device is present;
    default: ask torch)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    reasons = []
    if parallel.async_tp:
        from async_tp_linear import async_tp_refusal

        refusal = async_tp_refusal("cuda" if cuda else "cpu")
        if refusal is not None:
            reasons.append(f"parallel.async_tp=true: {refusal}")
    if parallel.fsdp_backend == "megatron":
        missing = []
        if not cuda:
            missing.append("a CUDA device (this machine has none)")
        if importlib.util.find_spec("megatron_fsdp") is None:
            missing.append(
                "the megatron-fsdp package (pip install 'qwen35-trainer[gpu]' or "
                "'fsdp-compat[megatron]')"
            )
        if missing:
            reasons.append("parallel.fsdp_backend=megatron needs " + " and ".join(missing))
        else:
            reasons.append(
                "parallel.fsdp_backend=megatron is not assembled into the trainer yet: "
                "megatron-fsdp returns a wrapper module (the trainer's objective, checkpoints "
                "and exports use the model in place), syncs gradients inside its optimizer's "
                "step (the trainer clips before it) and shards flat buffers by element ranges "
                "that it fills from whole parameters or each module's reset_parameters (the "
                "trainer fills each rank's rows of the meta-built model from the name-seeded "
                "initialisation or the checkpoint's slices); use parallel.fsdp_backend=fsdp2 "
                "(fsdp_compat.shard_model's megatron backend, SUM reductions included, works "
                "on its own)"
            )
        if parallel.ep > 1 or parallel.tp > 1:
            reasons.append(
                "parallel.fsdp_backend=megatron runs with parallel.ep=1 and parallel.tp=1: the "
                "trainer's expert mesh and its TP gradient rules are FSDP2's (megatron-fsdp "
                "derives its expert groups itself); use parallel.fsdp_backend=fsdp2"
            )
    return reasons
