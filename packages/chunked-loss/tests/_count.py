"""Count the matmuls a piece of code dispatches (below autograd, so backward counts too)."""

from __future__ import annotations

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


class MatmulCounter(TorchDispatchMode):
    """``with MatmulCounter() as c: ...`` then ``c.count``: the aten matmul calls made."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in MATMULS:
            self.count += 1
        return func(*args, **(kwargs or {}))
