"""Where the values of a base held in FP8 come from (:mod:`qwen35_trainer.model.fp8.hold`).

Each FP8 projection has two runtime parameters, its FP8 bytes and its scales
(:func:`fp8_role`). Both are read per shard, dim-0 rows ``lo:hi`` at a time, like every other
parameter:

- from an FP8 checkpoint, as stored (:meth:`~qwen35_trainer.model.weights.stored.Stored.fp8`,
  :meth:`~qwen35_trainer.model.weights.stored.Stored.scales`);
- from full-precision values — a bf16 checkpoint, or the name-seeded initialisation — quantized
  on load (:func:`quantized_reader`, :func:`moe_parallel.quantize`: per block ``amax / 448``).
  A 2-D weight's rows ``lo:hi`` are quantized from the whole block rows around them, and its
  scale rows ``lo:hi`` are block rows ``lo:hi``; the experts' rows are whole experts, read and
  quantized one at a time (the fp32 temporaries of one expert, not of a layer's). So every
  shard holds the bytes and scales quantizing the whole tensor would give.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from moe_parallel import BlockFormat, quantize
from moe_parallel.fp8_experts import EXPERT_FP8

__all__ = ["FP8Role", "fp8_reader", "fp8_role", "quantized_reader"]

RowReader = Callable[[int, int], torch.Tensor]


class FP8Role(NamedTuple):
    """A parameter of an FP8 weight: its ``weight`` attribute, whether it is the ``scale`` (else
    the FP8 bytes), the weight's full ``shape`` and block ``form``."""

    weight: str
    scale: bool
    shape: tuple[int, ...]
    form: BlockFormat


def fp8_role(module: nn.Module, attr: str) -> FP8Role | None:
    """The :class:`FP8Role` of ``module``'s parameter ``attr``, or ``None`` when it is not part
    of an FP8 weight."""
    form = getattr(module, "fp8_form", None)
    if form is not None and attr in ("weight", "weight_scale_inv"):
        return FP8Role("weight", attr != "weight", tuple(module.weight.shape), form)
    block = getattr(module, "fp8_block", None)
    if block is None:
        return None
    for weight, (scale, parts) in EXPERT_FP8.items():
        if attr in (weight, scale):
            shape = tuple(getattr(module, weight).shape)
            return FP8Role(weight, attr == scale, shape, BlockFormat(block, parts))
    return None


def quantized_reader(values: RowReader, role: FP8Role) -> RowReader:
    """Rows of the FP8 bytes (or, for ``role.scale``, of the scales) of the weight whose
    full-precision rows ``values`` reads (module docstring)."""
    form, shape = role.form, role.shape
    if len(shape) == 3:  # stacked experts: rows are whole matrices, quantized one at a time

        def experts(lo: int, hi: int) -> torch.Tensor:
            if hi <= lo:
                return quantize(values(lo, hi), form)[role.scale]
            return torch.cat([quantize(values(e, e + 1), form)[role.scale] for e in range(lo, hi)])

        return experts
    bo = form.block[0]

    def rows(lo: int, hi: int) -> torch.Tensor:
        if role.scale:  # block rows lo:hi
            return quantize(values(lo * bo, min(hi * bo, shape[0])), form)[1]
        first = lo // bo * bo
        data, _ = quantize(values(first, min(-(-hi // bo) * bo, shape[0])), form)
        return data[lo - first : hi - first]

    return rows


def fp8_reader(stored, role: FP8Role) -> RowReader:
    """How to read ``role``'s parameter from a checkpoint weight's :class:`~qwen35_trainer.
    model.stored.Stored`: as stored when it is FP8 (in the runtime's blocks), else quantized."""
    if stored.quantized:
        if tuple(stored.block) != tuple(role.form.block):
            raise ValueError(
                f"{stored.keys[0][0]}: FP8 blocks {list(stored.block)} on disk, the model holds "
                f"{list(role.form.block)}"
            )
        return stored.scales if role.scale else stored.fp8
    return quantized_reader(stored.values, role)
