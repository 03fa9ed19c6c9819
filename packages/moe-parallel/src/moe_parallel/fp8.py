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

Decoding (:func:`dequantize`): torch's float8 → float conversion is an
element-by-element scalar function on CPU (about 5 ns an element: the whole cost of an FP8
step there). The decode here is a table: a block with scale ``s`` holds at most 256 values,
``dtype(float32(b) · s)`` for the 256 bytes ``b``, so each block's 256 values are computed
first — with torch's own conversion of the 256 bytes, the same fp32 product and the same single
rounding to ``dtype`` as a by-hand dequantization — and every element is then gathered from its
block's table by its byte (``index_select``, about 0.7 ns an element on one CPU core with its
index arithmetic). The result is the by-hand formula bit for bit by construction, e4m3's
subnormals, both zeros and the NaN bytes (0x7F, 0xFF) included. The tables add 256 entries a
block (1/64 of the weight's elements for 128 × 128 blocks). The decode runs a few block rows at
a time (:func:`slice_elements`: a core's cache on CPU, ``CHUNK_ELEMENTS`` elsewhere); a slice's
int32 byte indices are its one temporary, :func:`scratch` memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "BlockFormat",
    "FP8Weight",
    "dequantize",
    "quantize",
    "scratch",
    "slice_elements",
]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
# elements decoded per slice off CPU: bounds the decode's index temporary (module docstring)
CHUNK_ELEMENTS = 1 << 24
# on CPU: a slice's int32 indices (4 bytes an element) and its output stay in a core's cache
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


_scratch = threading.local()


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``numel`` elements of working memory the caller fully overwrites and drops before asking
    again: on CPU a per-thread buffer reused call after call (a fresh one is pages faulted in
    every time, and NaN-filled under torch's deterministic mode), elsewhere a fresh tensor (the
    device's caching allocator reuses memory already)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


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


def _decode_into(out: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, form: BlockFormat):
    """``out`` ← the dequantized ``data`` (module docstring), a few block rows at a time: a block
    row's blocks have consecutive tables, so an element's table index is its byte plus its
    column block's offset, and the slice's first table is found by slicing the tables. Where
    the blocks tile each matrix's rows a slice takes several block rows of equal height (and
    may run on into the next matrix), otherwise one block row."""
    n, rows, cols = _grids(tuple(data.shape), form)
    bo, bi = form.block
    device = data.device
    scale_nbc = scale.reshape(n, -1, scale.shape[-1]).float()
    nbr, nbc = scale_nbc.shape[1:]
    per_block_row = nbc * _BYTES
    # every byte's value in every block: [n, nbr, nbc, 256], in the blocks' order
    tables = (scale_nbc[..., None] * _byte_values(device)).to(out.dtype).view(-1)
    tiled = rows % bo == 0
    group = max(1, slice_elements(device) // (bo * cols)) if tiled else 1
    index_dtype = torch.int32 if tables.numel() < 2**31 else torch.int64
    # [group, 1, cols]: the table index of byte 0 at each column of each block row of a slice
    block_col = torch.arange(cols, device=device) // bi * _BYTES
    block_row = torch.arange(group, device=device) * per_block_row
    base = (block_row[:, None, None] + block_col).to(index_dtype)
    index = scratch(group * bo * cols, index_dtype, device)
    bytes_Rc, out_Rc = data.view(torch.uint8).view(-1, cols), out.view(-1, cols)
    for g in range(0, n * nbr, group):
        count = min(group, n * nbr - g)
        matrix, block_row_in_matrix = divmod(g, nbr)
        a = matrix * rows + block_row_in_matrix * bo
        b = a + count * bo if tiled else min(a + bo, (matrix + 1) * rows)
        shape = (count, (b - a) // count, cols)
        idx = index[: (b - a) * cols].view(shape)
        idx.copy_(bytes_Rc[a:b].view(shape)).add_(base[:count])
        first = tables[g * per_block_row : (g + count) * per_block_row]
        torch.index_select(first, 0, idx.view(-1), out=out_Rc[a:b].view(-1))


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    form: BlockFormat,
    *,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``float32(data) · scale`` blockwise (module docstring), rounded once to ``dtype``, decoded
    by each block's table of its 256 values; written into ``out`` (contiguous, ``data``'s shape
    and ``dtype``) when given, else into a new tensor."""
    _check(data, scale, form)
    if out is None:
        out = torch.empty(data.shape, dtype=dtype, device=data.device)
    elif out.shape != data.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {list(data.shape)}, got "
            f"{'a contiguous' if out.is_contiguous() else 'a strided'} {out.dtype} tensor of "
            f"shape {list(out.shape)}"
        )
    if out.numel():
        _decode_into(out, data, scale, form)
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
