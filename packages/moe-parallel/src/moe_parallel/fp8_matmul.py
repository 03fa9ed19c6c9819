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

Stacked expert weights [E, O, I] may be computed in :class:`Piece`\\ s: runs of experts whose
rows are consecutive, each piece's experts dequantized and multiplied on their own (on CPU a
piece's weights fit a core's cache, where the whole [E, O, I] weight would be a fresh
allocation written and read back from memory; experts without rows are not decoded at all).
Each row is computed by the same per-expert product either way, so the result does not depend
on the pieces (tests: bit for bit against the whole weight).

Exactness: the products ``linear`` computes are those of the dequantized weight, which is the
by-hand dequantization bit for bit (:func:`moe_parallel.fp8.dequantize`). One exception, by
design: a 2-D weight in 128 × 128 blocks on a GPU that runs torch's block-scaled FP8 GEMM goes
through it instead (:mod:`moe_parallel.fp8_gemm`: no dequantized weight, the activations
rounded to e4m3 per 1 × 128 block).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moe_parallel.fp8 import FP8_DTYPE, BlockFormat, Decoder, FP8Weight
from moe_parallel.fp8_gemm import block_scaled_linear, takes_block_scaled_mm

__all__ = ["Piece", "fp8_linear"]

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Piece(NamedTuple):
    """Experts computed together: ``experts`` (a slice of the stacked weight's first dim),
    ``rows`` (their rows, a slice of ``x``'s first dim) and ``linear`` (those rows times those
    experts' weights)."""

    experts: slice
    rows: slice
    linear: Linear


def _run(x, data, scale, form: BlockFormat, pieces: Sequence[Piece], transpose: bool):
    """``linear(x, W)`` (``W^T`` with ``transpose``) piece by piece, the rows concatenated; the
    pieces' weights are dequantized into one buffer (each piece's product is computed before
    the next piece overwrites it)."""
    decoder = Decoder(data, scale, form, x.dtype)
    spans = [
        piece.experts.indices(data.shape[0]) if data.dim() > 2 else (0, 1, 1) for piece in pieces
    ]
    per_matrix = math.prod(data.shape[-2:])
    buffer = torch.empty(
        max(b - a for a, b, _ in spans) * per_matrix, dtype=x.dtype, device=x.device
    )
    ys = []
    for piece, (a, b, _) in zip(pieces, spans, strict=True):
        weight = decoder.into(buffer[: (b - a) * per_matrix], a, b).view(
            data[a:b].shape if data.dim() > 2 else data.shape
        )
        ys.append(piece.linear(x[piece.rows], weight.transpose(-2, -1) if transpose else weight))
    return ys[0] if len(ys) == 1 else torch.cat(ys)


class _DequantizedLinear(torch.autograd.Function):
    """``linear(x, dequantize(w))``; saves the FP8 bytes and scales, never the dequantized
    weight (module docstring). ``linear(g, W^T)`` is the input gradient of ``linear(x, W)``
    for each ``linear`` used here: ``F.linear`` and the grouped per-expert linears."""

    @staticmethod
    def forward(ctx, x, data, scale, form: BlockFormat, pieces: Sequence[Piece]):
        ctx.save_for_backward(data, scale)
        ctx.form, ctx.pieces = form, pieces
        return _run(x, data, scale, form, pieces, transpose=False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        data, scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        grad_x = _run(grad_y.contiguous(), data, scale, ctx.form, ctx.pieces, transpose=True)
        return grad_x, None, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: FP8Weight,
    linear: Linear = F.linear,
    *,
    pieces: Sequence[Piece] | None = None,
) -> torch.Tensor:
    """``linear(x, W)`` for the frozen FP8 ``weight`` (module docstring): ``F.linear`` for a
    2-D weight [O, I] (x [..., I] → [..., O]; on the block-scaled FP8 GEMM where
    :func:`moe_parallel.fp8_gemm.takes_block_scaled_mm`), or a grouped per-expert linear over stacked
    [E, O, I] weights, whole or in ``pieces`` (which then replace ``linear``; they cover the
    rows of ``x`` [M, I] in order, and at least one row); differentiable in ``x`` only."""
    if weight.data.dtype != FP8_DTYPE:
        raise TypeError(f"FP8Weight.data must be {FP8_DTYPE}, got {weight.data.dtype}")
    if pieces is None and linear is F.linear and takes_block_scaled_mm(x, weight):
        return block_scaled_linear(x, weight)
    if pieces is None:
        pieces = (Piece(slice(None), slice(None), linear),)
    elif not pieces:
        raise ValueError("fp8_linear: pieces must cover the rows of x, got none")
    return _DequantizedLinear.apply(x, weight.data, weight.scale, weight.form, tuple(pieces))
