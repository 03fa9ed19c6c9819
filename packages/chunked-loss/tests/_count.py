"""Count the matmuls a piece of code dispatches (below autograd, so backward counts too): calls
and multiply-add FLOPs, over aten's matmul ops and oneDNN's CPU linear op."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MATMULS = {
    torch.ops.aten.mm,
    torch.ops.aten.addmm,
    torch.ops.aten.addmm_,
    torch.ops.aten.matmul,
    torch.ops.aten.bmm,
    torch.ops.aten.baddbmm,
    torch.ops.aten.linear,
    torch.ops.mkldnn._linear_pointwise,
}
# ops whose second operand is a [out, in] weight (x @ wᵀ) rather than a [k, n] matrix
WEIGHT_LAST = {torch.ops.aten.linear, torch.ops.mkldnn._linear_pointwise}


def matmul_flops(func, args) -> int:
    """``2 · (output elements) · (reduction length)`` of one matmul call."""
    packet = func.overloadpacket
    a, b = (
        (args[1], args[2])
        if packet in {torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.baddbmm}
        else (args[0], args[1])
    )
    k = a.shape[-1]
    n = b.shape[-2] if packet in WEIGHT_LAST else b.shape[-1]
    return 2 * math.prod(a.shape[:-1]) * k * n


class MatmulCounter(TorchDispatchMode):
    """``with MatmulCounter() as c: ...`` then ``c.count`` (matmul calls) and ``c.flops``."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in MATMULS:
            self.count += 1
            self.flops += matmul_flops(func, args)
        return func(*args, **(kwargs or {}))
