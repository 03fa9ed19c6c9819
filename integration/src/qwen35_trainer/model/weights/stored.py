"""A runtime tensor's tensors on disk, their dtypes checked, read as the runtime holds it.

A runtime tensor comes from ONE on-disk tensor of its shape, or (the routed experts) from
per-expert tensors stacked along dim 0, each expert's the concatenation of its parts' rows
(``gate_proj`` then ``up_proj``; see :mod:`qwen35_trainer.model.weights.adapter`). On disk each is
either a float tensor or, in an FP8 checkpoint (Qwen's releases), float8_e4m3fn with its
``…_scale_inv`` block scales beside it (:mod:`moe_parallel.fp8`: ``W = fp8 · scale``
blockwise, blocks of the checkpoint's ``weight_block_size``, partial at the edges).

:class:`Stored` checks every tensor it will read before anything is read — an integer dtype, a
float8 without its scale or without a ``quantization_config`` giving the blocks, a scale of the
wrong shape, a mix of FP8 and float parts are problems naming the tensor and what was
expected — and then reads dim-0 rows ``lo:hi`` of the runtime tensor three ways:

- :meth:`Stored.values`: the weight's values (float; an FP8 tensor dequantized: the full
  fine-tuning of an FP8 checkpoint, or a module the trainer keeps in a float dtype);
- :meth:`Stored.fp8` / :meth:`Stored.scales`: the FP8 bytes and the scales as stored (the
  frozen base of a LoRA run kept in FP8); the experts' per-expert scales are stacked like their
  weights, the gate's block rows before the up's (``BlockFormat(..., parts=2)``).

Dequantizing rows ``lo:hi`` of a 2-D weight multiplies them by their blocks' rows of the scale:
the same products as dequantizing the whole tensor, so every shard reads what one process
reads.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_parallel import BlockFormat

__all__ = ["SCALE_SUFFIX", "Stored"]

SCALE_SUFFIX = "_scale_inv"
_FLOATS = ("F64", "F32", "BF16", "F16")
_FP8 = "F8_E4M3"


def scale_key(key: str) -> str:
    """The on-disk name of weight ``key``'s block scales."""
    return f"{key}{SCALE_SUFFIX}"


@dataclasses.dataclass
class Stored:
    """``keys[i]``: the on-disk parts of stacked index ``i`` (``stacked``: dim 0 indexes them,
    the experts) or the one tensor ``[[key]]``; ``quantized``: the parts are FP8 with scales
    in blocks of ``block``."""

    files: object
    keys: list[list[str]]
    stacked: bool
    quantized: bool = False
    block: tuple[int, int] | None = None

    @classmethod
    def check(cls, files, keys, stacked, block, problems: list[str]) -> Stored | None:
        """The :class:`Stored` of ``keys`` (every part's dtype and scale checked), or ``None``
        with the reasons appended to ``problems``."""
        flat = [k for ks in keys for k in ks]
        found: list[str] = []
        for key in flat:
            dtype = files.dtype(key)
            if dtype == _FP8:
                found += _scale_problems(files, key, block)
            elif dtype not in _FLOATS:
                found.append(
                    f"{key}: dtype {dtype} on disk, a float (F32, BF16, F16) or F8_E4M3 with its "
                    f"scale {scale_key(key)} expected"
                )
        fp8 = [files.dtype(k) == _FP8 for k in flat]
        if any(fp8) and not all(fp8):
            found.append(
                f"{flat[fp8.index(False)]}: {files.dtype(flat[fp8.index(False)])} beside "
                f"F8_E4M3 parts ({flat[fp8.index(True)]}) of the same runtime tensor"
            )
        if found:
            problems += found
            return None
        return cls(files, keys, stacked, bool(flat) and all(fp8), block)

    def used(self) -> list[str]:
        """Every on-disk tensor this reads (the scales included)."""
        flat = [k for ks in self.keys for k in ks]
        return flat + ([scale_key(k) for k in flat] if self.quantized else [])

    def _parts(self, lo: int, hi: int, read) -> torch.Tensor:
        """Rows ``lo:hi``: of the one tensor, or experts ``lo:hi`` each its parts' rows."""
        if not self.stacked:
            return read(self.keys[0][0], lo, hi)
        experts = [
            torch.cat([read(k, 0, self.files.shape(k)[0]) for k in self.keys[e]])
            for e in (range(lo, hi) if hi > lo else (0,))  # an empty span: expert 0's shape
        ]
        return torch.stack(experts)[: hi - lo]

    def values(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of the weight's values (an FP8 tensor dequantized, fp32)."""
        return self._parts(lo, hi, self._dequantized if self.quantized else self.files.rows)

    def fp8(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of the FP8 bytes as stored."""
        return self._parts(lo, hi, self.files.rows)

    def scales(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of the scales (fp32): block rows of a 2-D weight's, or experts'."""
        return self._parts(lo, hi, lambda k, a, b: self.files.rows(scale_key(k), a, b)).float()

    def _dequantized(self, key: str, lo: int, hi: int) -> torch.Tensor:
        rows = self.files.rows(key, lo, hi)
        if hi <= lo:
            return rows.float()
        bo, bi = self.block
        first, last = lo // bo, (hi - 1) // bo + 1
        scale = self.files.rows(scale_key(key), first, last).float()
        scale = scale.repeat_interleave(bo, 0)[lo - first * bo : hi - first * bo]
        return rows.float() * scale.repeat_interleave(bi, 1)[:, : rows.shape[1]]


def _scale_problems(files, key: str, block: tuple[int, int] | None) -> list[str]:
    """What is wrong with FP8 tensor ``key``'s scale (nothing: ``[]``)."""
    scale = scale_key(key)
    if block is None:
        return [
            f"{key}: F8_E4M3 on disk but the checkpoint's config.json has no quantization_config "
            "giving its block size (weight_block_size)"
        ]
    if scale not in files.where:
        return [f"{key}: F8_E4M3 on disk without its scale {scale}"]
    shape = files.shape(key)
    if len(shape) != 2:
        return [f"{key}: F8_E4M3 of shape {list(shape)}, a 2-D [out, in] weight expected"]
    want = BlockFormat(tuple(block)).scale_shape(shape)
    if files.shape(scale) != want or files.dtype(scale) not in _FLOATS:
        return [
            f"{scale}: {files.dtype(scale)} {list(files.shape(scale))} on disk, a float "
            f"{list(want)} expected for {key} {list(shape)} in blocks of {list(block)}"
        ]
    return []
