"""Frozen weights held in block-scaled FP8, dequantized where they are used.

The format is the one Qwen's (and DeepSeek's) FP8 checkpoints ship: a weight ``W`` [..., O, I]
is stored as ``data`` float8_e4m3fn [..., O, I] and ``scale`` [..., ceil(O / bo), ceil(I / bi)]
(``weight_scale_inv`` on disk) for a block of ``(bo, bi)`` elements, and

    W[..., o, i] = float(data[..., o, i]) · scale[..., o // bo, i // bi]

— the edge blocks of a dimension that is not a multiple of the block are partial. A fused
weight made of ``parts`` equal row ranges that were quantized separately (the experts'
``gate_up_proj``: gate rows then up rows, each its own per-expert tensor on disk) keeps each
part's block grid: its scale is ``[..., parts · ceil(O / parts / bo), ceil(I / bi)]``, part
``p``'s block rows after part ``p - 1``'s. :class:`BlockFormat` says which.

:func:`quantize` is the inverse used on load and on export: per block ``s = amax / 448`` (the
OCP e4m3 maximum; a block of zeros gets ``s = 1``), rounded to the scale's storage dtype first,
and ``data = e4m3(clamp(W / s, ±448))``; so ``dequantize(quantize(W))`` is ``W`` to e4m3's
resolution, and ``quantize(dequantize(data, scale)) == (data, scale)`` for a block whose amax
is representable.

:func:`fp8_linear` is the compute: ``y = linear(x, W)`` with ``W`` dequantized in the
activations' dtype for this call only. Its autograd function saves the FP8 bytes and the scales
(what the module holds anyway), never the dequantized ``W``, and dequantizes again in the
backward for ``dL/dx = linear(dL/dy, W^T)``; the weight is frozen and gets no gradient. So a
model holds its frozen base in one byte per element plus the scales, and at any moment at most
one dequantized weight (under activation checkpointing the recompute dequantizes again).
``dequantize`` fills its output in slices of at most ``CHUNK_ELEMENTS`` elements, which bounds
its fp32 temporaries.

Exactness: ``dequantize`` computes ``float32(data) · scale`` in fp32 and rounds once to the
output dtype — in fp32, exactly the weight a reference dequantizes by hand; the products
``linear`` computes are then those of that weight.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "BlockFormat",
    "FP8Weight",
    "dequantize",
    "fp8_linear",
    "quantize",
]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
# elements dequantized per slice: bounds the fp32 temporaries (two of this size)
CHUNK_ELEMENTS = 1 << 24


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """``block``: (rows, columns) of one scale's block; ``parts``: row ranges of the weight
    quantized separately (2 for a fused gate/up projection)."""

    block: tuple[int, int]
    parts: int = 1

    def __post_init__(self) -> None:
        rows, cols = self.block
        if min(rows, cols, self.parts) < 1:
            raise ValueError(f"block {self.block} and parts {self.parts} must be >= 1")

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale's shape for a weight of ``shape`` [..., O, I]; ``ValueError`` when O does
        not split into ``parts``."""
        *lead, rows, cols = shape
        if rows % self.parts:
            raise ValueError(f"{rows} rows do not split into {self.parts} equal parts")
        per_part = -(-(rows // self.parts) // self.block[0])
        return (*lead, self.parts * per_part, -(-cols // self.block[1]))


class FP8Weight(NamedTuple):
    """A frozen weight in FP8: ``data`` float8_e4m3fn [..., O, I], ``scale`` (fp32) of
    ``form.scale_shape(data.shape)``."""

    data: torch.Tensor
    scale: torch.Tensor
    form: BlockFormat

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def _grids(shape: tuple[int, ...], form: BlockFormat):
    """``(matrices, rows per part, columns)``: the weight seen as [N, o, I] of N = lead · parts
    separately blocked matrices."""
    *lead, rows, cols = shape
    return math.prod(lead) * form.parts, rows // form.parts, cols


def _expand(scale_nbc: torch.Tensor, block: tuple[int, int], rows: int, cols: int):
    """[n, nb_rows, nb_cols] block scales → [n, rows, cols], each block's scale repeated over
    it (edge blocks cut)."""
    bo, bi = block
    return scale_nbc.repeat_interleave(bo, 1)[:, :rows].repeat_interleave(bi, 2)[:, :, :cols]


def _scale_(piece_nrc: torch.Tensor, scale_nbc: torch.Tensor, block: tuple[int, int]) -> None:
    """Multiply fp32 ``piece_nrc`` [n, rows, cols] (whole block rows from a block boundary) by
    its blocks' scales, in place: broadcast over each block when the blocks tile it, else
    with the scales repeated over the edge blocks."""
    n, rows, cols = piece_nrc.shape
    bo, bi = block
    if rows % bo == 0 and cols % bi == 0:
        blocks = piece_nrc.view(n, rows // bo, bo, cols // bi, bi)
        blocks.mul_(scale_nbc[:, :, None, :, None])
    else:
        piece_nrc.mul_(_expand(scale_nbc, block, rows, cols))


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    form: BlockFormat,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``float32(data) · scale`` blockwise (module docstring), rounded once to ``dtype``; one
    fp32 slice of at most ``CHUNK_ELEMENTS`` at a time is the only temporary."""
    expected = form.scale_shape(tuple(data.shape))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale of shape {list(scale.shape)} for FP8 data {list(data.shape)}: expected "
            f"{list(expected)} for blocks of {list(form.block)}"
            + (f" in {form.parts} parts" if form.parts > 1 else "")
        )
    n, rows, cols = _grids(tuple(data.shape), form)
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    data_nrc, out_nrc = data.reshape(n, rows, cols), out.view(n, rows, cols)
    scale_nbc = scale.reshape(n, -1, scale.shape[-1]).float()
    bo = form.block[0]
    # slices of whole block rows (and of whole matrices when one is small)
    block_rows = max(1, min(-(-rows // bo), CHUNK_ELEMENTS // max(1, bo * cols)))
    matrices = max(1, CHUNK_ELEMENTS // max(1, rows * cols))
    for m in range(0, n, matrices):
        for b in range(0, -(-rows // bo), block_rows):
            r0, r1 = b * bo, min((b + block_rows) * bo, rows)
            piece = data_nrc[m : m + matrices, r0:r1].float()
            _scale_(piece, scale_nbc[m : m + matrices, b : b + block_rows], form.block)
            out_nrc[m : m + matrices, r0:r1] = piece
    return out


def quantize(
    weight: torch.Tensor,
    form: BlockFormat,
    *,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of ``weight`` [..., O, I] (module docstring): ``data``
    float8_e4m3fn, ``scale`` in ``scale_dtype`` (each block's ``amax / 448`` rounded to it,
    1 for a zero block; the FP8 values are computed against the rounded scale)."""
    n, rows, cols = _grids(tuple(weight.shape), form)
    bo, bi = form.block
    nbo, nbi = -(-rows // bo), -(-cols // bi)
    scale_shape = form.scale_shape(tuple(weight.shape))
    if weight.numel() == 0:  # an empty shard
        empty = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        return empty, torch.ones(scale_shape, dtype=scale_dtype, device=weight.device)
    w_nrc = weight.reshape(n, rows, cols).float()
    padded = F.pad(w_nrc.abs(), (0, nbi * bi - cols, 0, nbo * bo - rows))
    amax = padded.view(n, nbo, bo, nbi, bi).amax(dim=(2, 4))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(scale_dtype)
    ratio = w_nrc / _expand(scale.float(), form.block, rows, cols)
    data = ratio.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return data.reshape(weight.shape), scale.reshape(scale_shape)


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _DequantizedLinear(torch.autograd.Function):
    """``linear(x, dequantize(w))``; saves the FP8 bytes and scales, never the dequantized
    weight (module docstring). ``linear(g, W^T)`` is the input gradient of ``linear(x, W)``
    for each ``linear`` used here: ``F.linear`` and the grouped per-expert linears."""

    @staticmethod
    def forward(ctx, x, data, scale, form: BlockFormat, linear: Linear):
        ctx.save_for_backward(data, scale)
        ctx.form, ctx.linear = form, linear
        return linear(x, dequantize(data, scale, form, dtype=x.dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        data, scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        weight = dequantize(data, scale, ctx.form, dtype=grad_y.dtype)
        grad_x = ctx.linear(grad_y.contiguous(), weight.transpose(-2, -1))
        return grad_x, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: FP8Weight, linear: Linear = F.linear) -> torch.Tensor:
    """``linear(x, W)`` for the frozen FP8 ``weight`` (module docstring): ``F.linear`` for a
    2-D weight [O, I] (x [..., I] → [..., O]), or a grouped per-expert linear over stacked
    [E, O, I] weights; differentiable in ``x`` only."""
    if weight.data.dtype != FP8_DTYPE:
        raise TypeError(f"FP8Weight.data must be {FP8_DTYPE}, got {weight.data.dtype}")
    return _DequantizedLinear.apply(x, weight.data, weight.scale, weight.form, linear)
