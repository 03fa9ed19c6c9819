"""Count the matmuls a piece of code dispatches (below autograd, so backward counts too): calls
and FLOPs. (Under a dispatch mode the loss runs its matmuls on aten, see ``_matmul``.)"""

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
}


def matmul_flops(func, args) -> int:
    """``2 · (output elements) · (reduction length)`` of one matmul call."""
    packet = func.overloadpacket
    a, b = (
        (args[1], args[2])
        if packet in {torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.baddbmm}
        else (args[0], args[1])
    )
    k = a.shape[-1]
    n = b.shape[-2] if packet is torch.ops.aten.linear else b.shape[-1]  # linear: x @ wᵀ
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
