"""causal_conv1d on one rank: equal to F.conv1d run on each document separately (values and
gradients of x, weight, bias), with nn.Conv1d's weight shape accepted; bad input refused."""

from __future__ import annotations

import pytest
import torch
from gdn_reference import conv_per_document, cu_from_lengths

from cp_varlen_attn import causal_conv1d


@pytest.mark.parametrize(
    ("lengths", "kernel", "activation"),
    [([1, 2, 9, 1, 30], 4, "silu"), ([5, 1, 12], 2, None), ([20], 4, None)],
)
def test_conv_equals_per_document_conv1d(lengths, kernel, activation):
    gen = torch.Generator().manual_seed(0)
    t, c = sum(lengths), 5
    x = torch.randn(1, t, c, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(
        c, 1, kernel, generator=gen, dtype=torch.float64, requires_grad=True
    )  # nn.Conv1d's shape
    bias = torch.randn(c, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, t, c, generator=gen, dtype=torch.float64)
    cu = cu_from_lengths(lengths)
    out = causal_conv1d(x, weight, bias, cu_seqlens=torch.tensor(cu), activation=activation)
    ref = conv_per_document(x[0], weight[:, 0], bias, cu, activation).unsqueeze(0)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((out * w).sum(), [x, weight, bias])
    want = torch.autograd.grad((ref * w).sum(), [x, weight, bias])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_conv_matches_transformers_layer_conv_on_one_document():
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3, bias=True).double()
    x = torch.randn(1, 11, 6, dtype=torch.float64)
    ref = torch.nn.functional.silu(conv(x.transpose(1, 2))[..., :11]).transpose(1, 2)
    torch.testing.assert_close(
        causal_conv1d(x, conv.weight, conv.bias), ref, rtol=1e-12, atol=1e-12
    )


def test_conv_bad_input():
    x, w = torch.randn(1, 8, 3), torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"x must be \[1, T, C\]"):
        causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d(x, torch.randn(4, 4))
    with pytest.raises(ValueError, match="bias must be"):
        causal_conv1d(x, w, torch.randn(4))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="end at T=8"):
        causal_conv1d(x, w, cu_seqlens=[0, 3, 7])


def test_conv_backward_adds_each_row_in_a_fixed_order():
    """No accumulating index_put_ in the backward: on a multi-threaded CPU it adds a row's (up
    to ``kernel``) gradients with atomics in thread-timing order, so two identical steps could
    differ in the last bits (and a training run drift). index_select's backward (index_add_)
    adds them in index order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket in (
                torch.ops.aten.index_put,
                torch.ops.aten.index_put_,
                torch.ops.aten._index_put_impl_,
            ):
                accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
                seen.append(accumulate)
            return func(*args, **kwargs)

    x = torch.randn(1, 40, 8, requires_grad=True)
    weight = torch.randn(8, 4, requires_grad=True)
    out = causal_conv1d(x, weight, cu_seqlens=[0, 7, 40])
    with Ops():
        out.sum().backward()
    assert True not in seen


def test_conv_backward_repeats_bitwise_on_two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, 888, 64, generator=gen, requires_grad=True)
        weight = torch.randn(64, 4, generator=gen)
        w = torch.randn(1, 888, 64, generator=gen)
        cu = [0, 100, 250, 400, 600, 888]
        first = None
        for _ in range(300):
            (grad,) = torch.autograd.grad((causal_conv1d(x, weight, cu_seqlens=cu) * w).sum(), x)
            first = grad if first is None else first
            assert torch.equal(grad, first)
    finally:
        torch.set_num_threads(threads)
