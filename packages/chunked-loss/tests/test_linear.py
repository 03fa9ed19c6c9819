"""linear_cross_entropy vs F.cross_entropy on full float64 logits: values and all gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _reference import make_inputs, reference
from hypothesis import given, settings
from hypothesis import strategies as st

from chunked_loss import linear_cross_entropy
from dist_testkit import assert_close

TOL = {"rtol": 1e-4, "atol": 1e-5}


def run(hidden, weight, labels, bias=None, grad_out_seed=1, **kw):
    """Our loss and grads of (hidden, weight, bias) for a random upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    loss = linear_cross_entropy(leaves[0], leaves[1], labels, bias=b, **kw)
    grad_out = torch.randn(loss.shape, generator=torch.Generator().manual_seed(grad_out_seed))
    loss.backward(grad_out)
    return loss.detach(), [leaves[0].grad, leaves[1].grad, None if b is None else b.grad], grad_out


def check_parity(hidden, weight, labels, bias=None, tol=TOL, **kw):
    loss, grads, grad_out = run(hidden, weight, labels, bias, **kw)
    ref_kw = {k: v for k, v in kw.items() if k in ("reduction", "label_smoothing", "ignore_index")}
    ref_loss, ref_grads = reference(hidden, weight, labels, bias=bias, grad_out=grad_out, **ref_kw)
    assert loss.dtype == torch.float32
    assert_close(loss, ref_loss, name="loss", **tol)
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        if rg is None:
            assert g is None
        else:
            assert_close(g, rg, name=f"grad_{name}", **tol)


SHAPES = [  # (N, H, V, chunk_size): N % chunk != 0, V not a multiple of 8, chunk 1, chunk > N
    (37, 16, 29, 8),
    (64, 8, 101, 64),
    (5, 4, 3, 1),
    (20, 12, 50, 1000),
    (33, 8, 13, None),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_parity(shape, reduction, label_smoothing):
    n, h, v, chunk = shape
    hidden, weight, bias, labels = make_inputs(n, h, v, seed=n + v)
    check_parity(
        hidden,
        weight,
        labels,
        bias,
        chunk_size=chunk,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_batch_seq_input_no_bias_custom_ignore(reduction):
    hidden, weight, _, labels = make_inputs(18, 8, 23, ignore_index=0, shape=(3, 6), bias=False)
    loss, _, _ = run(hidden, weight, labels, ignore_index=0, chunk_size=4, reduction=reduction)
    if reduction == "none":
        assert loss.shape == (3, 6)
    check_parity(hidden, weight, labels, None, ignore_index=0, chunk_size=4, reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_is_zero_with_zero_grads(reduction):
    hidden, weight, bias, labels = make_inputs(10, 6, 11, ignore_frac=1.0)
    loss, grads, _ = run(hidden, weight, labels, bias, reduction=reduction, chunk_size=3)
    assert torch.equal(loss, torch.zeros_like(loss))
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))


def test_num_valid_tokens_divides_the_sum():
    hidden, weight, bias, labels = make_inputs(30, 8, 17)
    total, grads_sum, _ = run(hidden, weight, labels, bias, reduction="sum", chunk_size=7)
    for count in (123, torch.tensor(123)):
        loss, grads, _ = run(
            hidden, weight, labels, bias, reduction="mean", chunk_size=7, num_valid_tokens=count
        )
        assert_close(loss, total / 123, **TOL)
        for g, gs in zip(grads, grads_sum, strict=True):
            assert_close(g, gs / 123, **TOL)


def test_only_hidden_requires_grad():
    hidden, weight, bias, labels = make_inputs(12, 8, 9)
    h = hidden.clone().requires_grad_()
    linear_cross_entropy(h, weight, labels, bias=bias, chunk_size=5).backward()
    _, ref_grads = reference(hidden, weight, labels, bias=bias)
    assert_close(h.grad, ref_grads[0], **TOL)


def test_bf16_within_stated_tolerance():
    """bf16 inputs: loss within 1e-2 relative and gradients within 2e-2·max|grad| of the fp32
    reference on the same (bf16-rounded) inputs."""
    hidden, weight, bias, labels = make_inputs(64, 32, 77)
    hb, wb, bb = (t.bfloat16() for t in (hidden, weight, bias))
    loss, grads, grad_out = run(hb, wb, labels, bb, chunk_size=16, reduction="mean")
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    ref_loss, ref_grads = reference(
        hb.float(), wb.float(), labels, bias=bb.float(), grad_out=grad_out
    )
    assert_close(loss, ref_loss, rtol=1e-2, atol=0.0, name="loss")
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        assert_close(g, rg, rtol=0.0, atol=2e-2 * float(rg.abs().max()), name=f"grad_{name}")


def test_double_backward_raises():
    hidden, weight, bias, labels = make_inputs(8, 4, 5)
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, labels, bias=bias)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(loss, h, create_graph=True)


def _saved_bytes(fn):
    """Run fn under saved_tensors_hooks; return (total bytes saved, largest numel saved)."""
    sizes = []

    def pack(t):
        sizes.append((t.numel() * t.element_size(), t.numel(), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(s[0] for s in sizes), max(s[1] for s in sizes)


def test_saved_tensors_are_inputs_plus_one_chunk():
    n, h, v, chunk = 512, 16, 1000, 32
    hidden, weight, bias, labels = make_inputs(n, h, v)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    inputs = sum(t.numel() * t.element_size() for t in (*leaves, labels))
    ours, largest = _saved_bytes(
        lambda: linear_cross_entropy(
            leaves[0], leaves[1], labels, bias=leaves[2], chunk_size=chunk
        ).backward()
    )
    assert ours <= inputs + chunk * v * 4, (ours, inputs)
    assert largest < n * v
    # The bound is not vacuous: the naive loss saves [N, V] fp32 tensors.
    naive, naive_largest = _saved_bytes(
        lambda: F.cross_entropy(leaves[0] @ leaves[1].T + leaves[2], labels).backward()
    )
    assert naive_largest >= n * v and naive > inputs + chunk * v * 4


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 20),
    v=st.integers(1, 17),
    chunk=st.integers(1, 9),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    smoothing=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 1000),
)
def test_parity_property(n, v, chunk, reduction, smoothing, seed):
    hidden, weight, bias, labels = make_inputs(n, 5, v, seed=seed)
    check_parity(
        hidden,
        weight,
        labels,
        bias,
        chunk_size=chunk,
        reduction=reduction,
        label_smoothing=smoothing,
    )
