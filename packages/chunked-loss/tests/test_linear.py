"""linear_cross_entropy vs F.cross_entropy on full float64 logits: values and all gradients.

Every parity test runs on both paths, ``grad_in_forward=True`` (gradients formed in the forward,
scalar reductions only) and ``False`` (backward recomputes each chunk), each with the compiled
per-chunk kernels (``compiled=True``: a fallback would raise, so these really test Inductor's
kernels) and the eager ones. For ``reduction="none"`` the first path must raise, so those cases
check the error instead."""

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


PATHS = pytest.mark.parametrize(
    "path",
    [
        {"grad_in_forward": gif, "compiled": compiled}
        for gif in (True, False)
        for compiled in (True, False)
    ],
    ids=[
        "grad_in_forward-compiled",
        "grad_in_forward-eager",
        "recompute-compiled",
        "recompute-eager",
    ],
)


def check_parity(hidden, weight, labels, bias=None, tol=TOL, **kw):
    if kw.get("grad_in_forward") and kw.get("reduction") == "none":
        with pytest.raises(ValueError, match=r'needs a scalar loss .* got reduction="none"'):
            run(hidden, weight, labels, bias, **kw)
        return
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
@PATHS
def test_parity(shape, reduction, label_smoothing, path):
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
        **path,
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
@PATHS
def test_batch_seq_input_no_bias_custom_ignore(reduction, path):
    hidden, weight, _, labels = make_inputs(18, 8, 23, ignore_index=0, shape=(3, 6), bias=False)
    kw = {"ignore_index": 0, "chunk_size": 4, "reduction": reduction, **path}
    if reduction == "none":
        loss, _, _ = run(hidden, weight, labels, **{**kw, "grad_in_forward": None})
        assert loss.shape == (3, 6)
    check_parity(hidden, weight, labels, None, **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@PATHS
def test_all_ignored_is_zero_with_zero_grads(reduction, path):
    hidden, weight, bias, labels = make_inputs(10, 6, 11, ignore_frac=1.0)
    gif = path["grad_in_forward"] and reduction != "none"
    loss, grads, _ = run(
        hidden,
        weight,
        labels,
        bias,
        reduction=reduction,
        chunk_size=3,
        grad_in_forward=gif,
        compiled=path["compiled"],
    )
    assert torch.equal(loss, torch.zeros_like(loss))
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))


@PATHS
def test_num_valid_tokens_divides_the_sum(path):
    hidden, weight, bias, labels = make_inputs(30, 8, 17)
    kw = {"chunk_size": 7, **path}
    total, grads_sum, _ = run(hidden, weight, labels, bias, reduction="sum", **kw)
    for count in (123, torch.tensor(123)):
        loss, grads, _ = run(
            hidden, weight, labels, bias, reduction="mean", num_valid_tokens=count, **kw
        )
        assert_close(loss, total / 123, **TOL)
        for g, gs in zip(grads, grads_sum, strict=True):
            assert_close(g, gs / 123, **TOL)


@PATHS
def test_only_hidden_requires_grad(path):
    hidden, weight, bias, labels = make_inputs(12, 8, 9)
    h = hidden.clone().requires_grad_()
    linear_cross_entropy(h, weight, labels, bias=bias, chunk_size=5, **path).backward()
    _, ref_grads = reference(hidden, weight, labels, bias=bias)
    assert_close(h.grad, ref_grads[0], **TOL)


@PATHS
def test_bf16_within_stated_tolerance(path):
    """bf16 inputs: loss within 1e-2 relative and gradients within 2e-2·max|grad| of the fp32
    reference on the same (bf16-rounded) inputs."""
    hidden, weight, bias, labels = make_inputs(64, 32, 77)
    hb, wb, bb = (t.bfloat16() for t in (hidden, weight, bias))
    loss, grads, grad_out = run(hb, wb, labels, bb, chunk_size=16, reduction="mean", **path)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    ref_loss, ref_grads = reference(
        hb.float(), wb.float(), labels, bias=bb.float(), grad_out=grad_out
    )
    assert_close(loss, ref_loss, rtol=1e-2, atol=0.0, name="loss")
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        assert_close(g, rg, rtol=0.0, atol=2e-2 * float(rg.abs().max()), name=f"grad_{name}")


@PATHS
def test_double_backward_raises(path):
    hidden, weight, bias, labels = make_inputs(8, 4, 5)
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, labels, bias=bias, **path)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(loss, h, create_graph=True)


def test_retain_graph_second_backward():
    """Recompute: a second backward adds the same gradient again. Gradient in forward: the
    saved gradients were scaled in place by the first backward, so the second one raises."""
    hidden, weight, bias, labels = make_inputs(9, 4, 7)
    _, ref_grads = reference(hidden, weight, labels, bias=bias)
    for gif in (False, True):
        h = hidden.clone().requires_grad_()
        loss = linear_cross_entropy(h, weight, labels, bias=bias, grad_in_forward=gif)
        loss.backward(retain_graph=True)
        assert_close(h.grad, ref_grads[0], **TOL)
        if gif:
            with pytest.raises(RuntimeError, match="backpropagated twice"):
                loss.backward()
        else:
            loss.backward()
            assert_close(h.grad, 2 * ref_grads[0], **TOL)


def test_grad_in_forward_hands_its_buffer_to_grad():
    """The backward scales the saved weight gradient in place and autograd stores that very
    buffer as ``.grad``: no second [V, H] tensor is allocated."""
    hidden, weight, _, labels = make_inputs(16, 8, 30)
    w = weight.clone().requires_grad_()
    pointers = []

    def pack(t):
        pointers.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = linear_cross_entropy(hidden, w, labels, chunk_size=5, grad_in_forward=True)
    loss.backward(torch.tensor(0.5))
    assert w.grad.data_ptr() in pointers
    _, ref_grads = reference(hidden, weight, labels, grad_out=torch.tensor(0.5))
    assert_close(w.grad, ref_grads[1], **TOL)


def _saved(fn):
    """Run fn under saved_tensors_hooks; return the (numel, bytes, shape) of each saved tensor."""
    saved = []

    def pack(t):
        saved.append((t.numel(), t.numel() * t.element_size(), tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@PATHS
def test_saved_tensors_are_inputs_plus_one_chunk(path):
    n, h, v, chunk = 512, 16, 1000, 32
    hidden, weight, bias, labels = make_inputs(n, h, v)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    inputs = sum(t.numel() * t.element_size() for t in (*leaves, labels))
    ours = _saved(
        lambda: linear_cross_entropy(
            leaves[0], leaves[1], labels, bias=leaves[2], chunk_size=chunk, **path
        ).backward()
    )
    assert sum(s[1] for s in ours) <= inputs + chunk * v * 4, (ours, inputs)
    assert max(s[0] for s in ours) < n * v
    if path[
        "grad_in_forward"
    ]:  # the three gradients (shapes of hidden, weight, bias) and scalars, nothing else
        assert sorted(s[2] for s in ours if s[0] > 1) == sorted([(n, h), (v, h), (v,)])
        assert sum(s[1] for s in ours) <= sum(t.numel() * 4 for t in leaves) + 64
    # The bound is not vacuous: the naive loss saves [N, V] fp32 tensors.
    naive = _saved(lambda: F.cross_entropy(leaves[0] @ leaves[1].T + leaves[2], labels).backward())
    assert max(s[0] for s in naive) >= n * v
    assert sum(s[1] for s in naive) > inputs + chunk * v * 4


def test_auto_picks_grad_in_forward_only_for_scalar_losses_with_grad():
    """Auto mode: the fused path (saves no [N] log-sum-exp, no labels) for "mean"/"sum" with a
    tensor requiring grad; the recompute path for "none"; no_grad needs neither."""
    n, h, v = 40, 6, 50
    hidden, weight, bias, labels = make_inputs(n, h, v)
    w = weight.clone().requires_grad_()

    def shapes(reduction):
        saved = _saved(lambda: linear_cross_entropy(hidden, w, labels, reduction=reduction))
        return sorted(s[2] for s in saved if s[0] > 1)

    assert shapes("mean") == shapes("sum") == [(v, h)]  # only grad_weight is needed
    valid = int((labels != -100).sum())
    assert shapes("none") == sorted([(n, h), (v, h), (n,), (valid,)])  # inputs + lse of valid
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, w, labels, bias=bias, chunk_size=7)
    ref_loss, _ = reference(hidden, weight, labels, bias=bias)
    assert_close(loss, ref_loss, **TOL)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 20),
    v=st.integers(1, 17),
    chunk=st.integers(1, 9),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    smoothing=st.sampled_from([0.0, 0.3]),
    gif=st.booleans(),
    compiled=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_parity_property(n, v, chunk, reduction, smoothing, gif, compiled, seed):
    hidden, weight, bias, labels = make_inputs(n, 5, v, seed=seed)
    check_parity(
        hidden,
        weight,
        labels,
        bias,
        chunk_size=chunk,
        reduction=reduction,
        label_smoothing=smoothing,
        grad_in_forward=gif,
        compiled=compiled,
    )
