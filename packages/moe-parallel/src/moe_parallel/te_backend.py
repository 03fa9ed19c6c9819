"""TransformerEngine's ``GroupedLinear`` as the expert compute (``expert_backend="te"``).

The experts keep their stacked transformers-layout weights (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]; DTensor shards under EP), so checkpoints and expert parallelism are the
same for every backend. TE's module owns one ``weight{e}`` parameter per GEMM instead; here it
is used as a compute shell: its own weights are dropped once, and for each call the per-expert
views ``W[e]`` of the stacked weights are set as its ``weight{e}`` attributes, which is where
TE reads them from. TE's autograd function takes the weights as inputs, so their gradients flow
through the views into the stacked parameter (and on into the DTensor under EP).

Zero-token experts: TE allocates the weight-gradient buffer of a grouped GEMM with
``torch.empty`` and an expert with zero rows contributes a GEMM with an empty reduction
dimension, so what lands in its slice is whatever the kernel and version leave there. A gradient
hook on the view of every expert that received no rows replaces it with zeros. The stacked
parameter therefore always gets a gradient, exactly zero for idle experts, never ``None`` and
never stale memory: the same contract as the torch backend.

A call with no rows at all never reaches TE: :func:`moe_parallel.expert_swiglu` sends it to the
exact per-expert loop, which gives zero gradients.

TransformerEngine is imported lazily: ``pip install 'moe-parallel[te]'`` on a CUDA machine.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["te_available", "te_expert_swiglu", "zero_idle_expert_grads"]

TE_DEVICE_TYPES = ("cuda",)
_log = logging.getLogger(__name__)


@functools.cache
def te_available() -> bool:
    """Whether ``transformer_engine.pytorch`` imports (checked once; the reason logged if not)."""
    try:
        _grouped_linear_class()
    except ImportError as err:
        _log.info("expert_backend='auto' uses torch: %s", err)
        return False
    return True


def _grouped_linear_class() -> type:
    try:
        from transformer_engine.pytorch import GroupedLinear
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "expert_backend='te' needs TransformerEngine (`pip install 'moe-parallel[te]'` "
            f"on a CUDA machine); importing transformer_engine.pytorch failed: {err!r}"
        ) from err
    return GroupedLinear


@functools.cache
def _shell(num_gemms: int, in_features: int, out_features: int, dtype, device: str) -> Any:
    """A TE ``GroupedLinear`` without parameters of its own (one per shape, dtype and device)."""
    module = _grouped_linear_class()(
        num_gemms, in_features, out_features, bias=False, params_dtype=dtype, device=device
    )
    for e in range(num_gemms):
        del module._parameters[f"weight{e}"]
    return module


def zero_idle_expert_grads(w_E: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """Views ``w_E[e]``; the gradient reaching the view of an expert with 0 rows becomes zeros."""
    views = list(w_E.unbind(0))
    if w_E.requires_grad:
        for view, rows in zip(views, counts, strict=True):
            if rows == 0:
                view.register_hook(torch.zeros_like)
    return views


def _grouped_linear(x_MI: torch.Tensor, counts: list[int], w_EOI: torch.Tensor) -> torch.Tensor:
    num_gemms, out_features, in_features = w_EOI.shape
    shell = _shell(num_gemms, in_features, out_features, w_EOI.dtype, str(w_EOI.device))
    views = zero_idle_expert_grads(w_EOI, counts)
    try:
        for e, view in enumerate(views):
            shell.__dict__[f"weight{e}"] = view  # plain attributes: where TE looks them up
        return shell(x_MI, counts)
    finally:
        for e in range(num_gemms):
            shell.__dict__.pop(f"weight{e}", None)


def te_expert_swiglu(
    x_MH: torch.Tensor, counts_E: torch.Tensor, gate_up_E2IH: torch.Tensor, down_EHI: torch.Tensor
) -> torch.Tensor:
    """:func:`moe_parallel.expert_swiglu` computed by two TE grouped linears (same contract).

    Needs at least one row (``expert_swiglu`` handles the empty call) and CUDA tensors.
    """
    if x_MH.device.type not in TE_DEVICE_TYPES:
        raise ValueError(
            f"expert_backend='te' runs on CUDA tensors, got rows on {x_MH.device}; "
            "use expert_backend='torch' elsewhere"
        )
    counts = [int(c) for c in counts_E.tolist()]
    gate, up = _grouped_linear(x_MH, counts, gate_up_E2IH).chunk(2, dim=-1)
    return _grouped_linear(F.silu(gate) * up, counts, down_EHI)
