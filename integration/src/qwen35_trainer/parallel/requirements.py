"""What a layout needs from the machine, checked before any rank builds anything.

:func:`machine_refusals` gives every reason the recipe's ``parallel`` section cannot run here —
async TP off CUDA / NCCL (async-tp-linear's own reason, :func:`async_tp_linear.async_tp_refusal`),
megatron-fsdp without CUDA streams or its package — so
:func:`qwen35_trainer.parallel.validate_layout` refuses the recipe in one message (with the
combinations the trainer does not run on megatron-fsdp,
:func:`qwen35_trainer.parallel.megatron.megatron_refusals`). Every rank of a launch runs the same
checks on the same recipe and machine, so every rank exits the same way, before any collective.
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
    # dist_testkit.cpu_cuda_streams' stand-ins (megatron-fsdp trained on CPU ranks in the tests)
    streams = cuda or getattr(torch.cuda.Stream, "runs_on_cpu", False)
    reasons = []
    if parallel.async_tp:
        from async_tp_linear import async_tp_refusal

        refusal = async_tp_refusal("cuda" if cuda else "cpu")
        if refusal is not None:
            reasons.append(f"parallel.async_tp=true: {refusal}")
    if parallel.fsdp_backend == "megatron":
        missing = []
        if not streams:
            missing.append("a CUDA device (this machine has none)")
        if importlib.util.find_spec("megatron_fsdp") is None:
            missing.append(
                "the megatron-fsdp package (pip install 'qwen35-trainer[gpu]' or "
                "'fsdp-compat[megatron]')"
            )
        if missing:
            reasons.append("parallel.fsdp_backend=megatron needs " + " and ".join(missing))
    return reasons
