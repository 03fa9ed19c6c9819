"""The MoE backward is bitwise repeatable on a multi-threaded CPU.

Each token is copied to its k experts' rows; the backward adds the k gradient rows back into the
token's. Advanced indexing (``x[order // k]``) would do that with an accumulating
``index_put_``, which a multi-threaded CPU runs with atomic adds in thread-timing order: with
k >= 3 two identical steps then differ in the last bits and a training run drifts.
``index_select`` adds them in a fixed order."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_parallel import MoE


def _moe_and_input(k: int):
    torch.manual_seed(0)
    moe = MoE(32, 16, k, 16, 16, init_std=0.3)
    x = torch.randn(4, 128, 32, requires_grad=True)
    return moe, x


def test_no_accumulating_index_put_in_the_backward():
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket in (
                torch.ops.aten.index_put,
                torch.ops.aten.index_put_,
                torch.ops.aten._index_put_impl_,
            ):
                seen.append(kwargs.get("accumulate", args[3] if len(args) > 3 else False))
            return func(*args, **kwargs)

    moe, x = _moe_and_input(k=8)
    out = moe(x)
    with Ops():
        out.square().sum().backward()
    assert True not in seen


def test_backward_repeats_bitwise_on_two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        moe, x = _moe_and_input(k=8)
        first = None
        for _ in range(100):
            (grad,) = torch.autograd.grad(moe(x).square().sum(), x)
            first = grad if first is None else first
            assert torch.equal(grad, first)
    finally:
        torch.set_num_threads(threads)
