"""The linear of a frozen FP8 weight (:mod:`moe_parallel.fp8`): ``y = linear(x, W)``.

:func:`fp8_linear` computes ``linear(x, dequantize(W))`` with ``W`` dequantized in the
activations' dtype for this call only. Its autograd function saves the FP8 bytes and the scales
(what the module holds anyway), never the dequantized ``W``, and dequantizes again in the
backward for ``dL/dx = linear(dL/dy, W^T)``; the weight is frozen and gets no gradient. So a
model holds its frozen base in one byte per element plus the scales, and at any moment at most
one dequantized weight (under activation checkpointing the recompute dequantizes again). Saving
the dequantized weight for the backward instead would skip the second decode at the price of
every FP8 weight of the step held in the compute dtype until its backward: 2 bytes an element
more than the FP8 base itself, the memory FP8 exists to save.

Exactness: the products ``linear`` computes are those of the dequantized weight, which is the
by-hand dequantization bit for bit (:func:`moe_parallel.fp8.dequantize`). One exception, by
design: a 2-D weight in 128 × 128 blocks on a GPU that runs torch's block-scaled FP8 GEMM goes
through it instead (:mod:`moe_parallel.fp8_gemm`: no dequantized weight, the activations
rounded to e4m3 per 1 × 128 block).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_parallel.fp8 import FP8_DTYPE, BlockFormat, FP8Weight, dequantize, scratch
from moe_parallel.fp8_gemm import block_scaled_linear, takes_block_scaled_mm

__all__ = ["fp8_linear"]

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _DequantizedLinear(torch.autograd.Function):
    """``linear(x, dequantize(w))``; saves the FP8 bytes and scales, never the dequantized
    weight (module docstring). ``linear(g, W^T)`` is the input gradient of ``linear(x, W)``
    for each ``linear`` used here: ``F.linear`` and the grouped per-expert linears."""

    @staticmethod
    def forward(ctx, x, data, scale, form: BlockFormat, linear: Linear):
        ctx.save_for_backward(data, scale)
        ctx.form, ctx.linear = form, linear
        return linear(x, _dequantized(data, scale, form, x.dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        data, scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        weight = _dequantized(data, scale, ctx.form, grad_y.dtype)
        grad_x = ctx.linear(grad_y.contiguous(), weight.transpose(-2, -1))
        return grad_x, None, None, None, None


def _dequantized(data, scale, form: BlockFormat, dtype) -> torch.Tensor:
    """The weight dequantized for one product, in :func:`moe_parallel.fp8.scratch` memory (the
    product is computed before anything decodes again)."""
    out = scratch(data.numel(), dtype, data.device).view(data.shape)
    return dequantize(data, scale, form, dtype=dtype, out=out)


def fp8_linear(x: torch.Tensor, weight: FP8Weight, linear: Linear = F.linear) -> torch.Tensor:
    """``linear(x, W)`` for the frozen FP8 ``weight`` (module docstring): ``F.linear`` for a
    2-D weight [O, I] (x [..., I] → [..., O]; on the block-scaled FP8 GEMM where
    :func:`moe_parallel.fp8_gemm.takes_block_scaled_mm`), or a grouped per-expert linear over
    stacked [E, O, I] weights; differentiable in ``x`` only."""
    if weight.data.dtype != FP8_DTYPE:
        raise TypeError(f"FP8Weight.data must be {FP8_DTYPE}, got {weight.data.dtype}")
    if linear is F.linear and takes_block_scaled_mm(x, weight):
        return block_scaled_linear(x, weight)
    return _DequantizedLinear.apply(x, weight.data, weight.scale, weight.form, linear)
