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

Decoding (:func:`dequantize`): torch's float8 → float conversion is an element-by-element
scalar function on CPU (about 5 ns an element, the whole cost of an FP8 step there). The decode
here is a table: a block with scale ``s`` can only hold 256 values, ``dtype(float32(b) · s)``
for the 256 bytes ``b``, so each block's 256 values are computed first (with torch's own
conversion of the 256 bytes, the same fp32 product and the same single rounding to ``dtype``
as a by-hand dequantization) and every element is then GATHERED from its block's table by its
byte (``index_select``, vectorised). The result is today's formula bit for bit by
construction, including the edge cases: e4m3's subnormals, signed zeros and the NaN bytes
(0x7F, 0xFF). It works in slices of whole block rows (or of whole matrices when one is small):
:func:`slice_elements` elements on CPU (the byte indices, the tables and the output slice stay
in the core's cache), ``CHUNK_ELEMENTS`` elsewhere; a slice's int32 indices are its only
temporary the size of the slice.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "BlockFormat",
    "Decoder",
    "FP8Weight",
    "dequantize",
    "quantize",
    "slice_elements",
]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
# elements dequantized per slice off CPU: bounds the decode's temporaries (module docstring)
CHUNK_ELEMENTS = 1 << 24
# on CPU: a slice's int32 indices (4 bytes an element) and its output stay in a core's L2
CPU_SLICE_ELEMENTS = 1 << 18
# a table's entries: one per byte value
_BYTES = 256


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


def slice_elements(device: torch.device) -> int:
    """How many elements :func:`dequantize` decodes at a time on ``device`` (module docstring)."""
    return CPU_SLICE_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS


@functools.cache
def _byte_values(device: torch.device) -> torch.Tensor:
    """[256] fp32: the e4m3 value of each byte, by torch's own conversion (the reference)."""
    return torch.arange(_BYTES, dtype=torch.uint8, device=device).view(FP8_DTYPE).float()


def _check(data: torch.Tensor, scale: torch.Tensor, form: BlockFormat) -> None:
    expected = form.scale_shape(tuple(data.shape))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale of shape {list(scale.shape)} for FP8 data {list(data.shape)}: expected "
            f"{list(expected)} for blocks of {list(form.block)}"
            + (f" in {form.parts} parts" if form.parts > 1 else "")
        )
    if data.dtype != FP8_DTYPE:
        raise TypeError(f"FP8 data must be {FP8_DTYPE}, got {data.dtype}")


class Decoder:
    """The tables of one FP8 weight (module docstring), to dequantize any range of its matrices
    into ``dtype``: :meth:`into` writes stacked matrices ``[m0, m1)`` (of the weight's first
    dim; the whole 2-D weight for ``(0, 1)``) into a buffer, so a caller that dequantizes
    piece after piece reuses one buffer and builds the tables once.

    The weight is decoded a few block rows at a time (:func:`slice_elements`): a block row's
    blocks have consecutive tables, so an element's table index is its byte plus the offset of
    its column's block in the block row (and the first block row's tables are found by slicing
    the tables). Where the row blocks tile each matrix, a slice takes several block rows
    (equal heights); otherwise one block row at a time.
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, form: BlockFormat, dtype):
        _check(data, scale, form)
        n, self.rows, cols = _grids(tuple(data.shape), form)
        self.bo, bi = form.block
        device = data.device
        scale_nbc = scale.reshape(n, -1, scale.shape[-1]).float()
        self.nbr, nbc = scale_nbc.shape[1:]
        self.per_block_row = nbc * _BYTES
        # every byte's value in every block: [n, nbr, nbc, 256], in the blocks' order
        self.tables = (scale_nbc[..., None] * _byte_values(device)).to(dtype).view(-1)
        tiled = self.rows % self.bo == 0
        self.group = max(1, slice_elements(device) // (self.bo * cols)) if tiled else 1
        # [group, 1, cols]: the table index of byte 0 at each column of each block row
        block_col = torch.arange(cols, device=device) // bi * _BYTES
        block_row = torch.arange(self.group, device=device) * self.per_block_row
        index_dtype = torch.int32 if self.tables.numel() < 2**31 else torch.int64
        self.base = (block_row[:, None, None] + block_col).to(index_dtype)
        self.index = torch.empty(self.group * self.bo * cols, dtype=index_dtype, device=device)
        self.bytes_Rc = data.view(torch.uint8).view(-1, cols)
        self.matrix_rows = self.rows * form.parts  # rows of one matrix of data's first dim
        self.dtype = dtype

    def into(self, out: torch.Tensor, m0: int = 0, m1: int = 1) -> torch.Tensor:
        """``out`` (contiguous, ``dtype``) ← the dequantized matrices ``[m0, m1)``; returns it."""
        cols = self.bytes_Rc.shape[1]
        first_row = m0 * self.matrix_rows
        size = (m1 - m0) * self.matrix_rows * cols
        if out.numel() != size or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {self.dtype} tensor of {size} elements, got "
                f"{out.dtype} {list(out.shape)}"
            )
        out_Rc = out.view(-1, cols)
        parts = self.matrix_rows // self.rows
        for g in range(m0 * parts * self.nbr, m1 * parts * self.nbr, self.group):
            count = min(self.group, m1 * parts * self.nbr - g)
            part, block_row = divmod(g, self.nbr)
            a = part * self.rows + block_row * self.bo
            b = (
                min(a + count * self.bo, part * self.rows + self.rows)
                if count == 1
                else a + count * self.bo
            )
            shape = (count, (b - a) // count, cols)
            idx = self.index[: b * cols - a * cols].view(shape)
            idx.copy_(self.bytes_Rc[a:b].view(shape)).add_(self.base[:count])
            tables = self.tables[g * self.per_block_row : (g + count) * self.per_block_row]
            torch.index_select(
                tables, 0, idx.view(-1), out=out_Rc[a - first_row : b - first_row].view(-1)
            )
        return out


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    form: BlockFormat,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``float32(data) · scale`` blockwise (module docstring), rounded once to ``dtype``, decoded
    by each block's table of its 256 values, a slice of :func:`slice_elements` at a time."""
    decoder = Decoder(data, scale, form, dtype)
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    if out.numel():
        decoder.into(out, 0, math.prod(data.shape[:-2]))
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
