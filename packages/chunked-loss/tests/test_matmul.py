"""The chunk matmuls' two CPU backends (``_matmul``): oneDNN (the CPU fp32 default) and aten.

Both against the float64 reference and each other, with the oneDNN products cut into many
slices (``SLICE_BYTES`` shrunk) so the slice loops really run, on both loss paths; exactly the
FLOPs of the three products either way; the backend choice (environment, dtype, layout, a
dispatch mode, for which torch's FLOP counter then counts the loss) and the logged fallback
when oneDNN is missing; a strided bias (which oneDNN misreads) made safe."""

from __future__ import annotations

import logging

import pytest
import torch
from _count import MatmulCounter
from _reference import make_inputs, reference
from torch.utils.flop_counter import FlopCounterMode

from chunked_loss import _compat, _matmul, linear_cross_entropy
from dist_testkit import assert_close

TOL = {"rtol": 1e-4, "atol": 1e-5}


class OneDNNCounter:
    """Stands in for ``_matmul._onednn()``: the real op, counting its calls and FLOPs."""

    def __init__(self) -> None:
        self.linear = _matmul._onednn()
        self.count = self.flops = 0

    def __call__(self, x_MK, w_NK, *args):
        self.count += 1
        self.flops += 2 * x_MK.shape[0] * x_MK.shape[1] * w_NK.shape[0]
        return self.linear(x_MK, w_NK, *args)


@pytest.fixture
def onednn(monkeypatch):
    counter = OneDNNCounter()
    assert counter.linear is not None, "this torch has no oneDNN"
    monkeypatch.setattr(_matmul, "_onednn", lambda: counter)
    return counter


def _run(hidden, weight, bias, labels, **kw):
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = linear_cross_entropy(leaves[0], leaves[1], labels, bias=leaves[2], **kw)
    loss.backward(torch.full_like(loss, 0.7))
    return [loss.detach()] + [t.grad for t in leaves]


@pytest.fixture
def fresh_probe():
    _matmul._onednn.cache_clear()
    yield
    _matmul._onednn.cache_clear()


@pytest.mark.parametrize("gif", [True, False], ids=["grad_in_forward", "recompute"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_backends_match_the_reference_with_many_slices(monkeypatch, onednn, gif, smoothing):
    # 47 valid rows in chunks of 16 (tail 15); at 16 rows a 200-byte slice is 3 logits columns
    # and, at H = 12, 4 weight-gradient rows: 17 and 13 slices of V = 50, the last ones short.
    monkeypatch.setattr(_matmul, "SLICE_BYTES", 200)
    hidden, weight, bias, labels = make_inputs(60, 12, 50, seed=11, ignore_frac=0.25)
    valid = int((labels != -100).sum())
    products = 3 if gif else 4
    kw = {"chunk_size": 16, "grad_in_forward": gif, "label_smoothing": smoothing}
    ref_loss, ref_grads = reference(
        hidden, weight, labels, bias=bias, label_smoothing=smoothing, grad_out=torch.tensor(0.7)
    )
    results = {}
    for env in _matmul.BACKENDS:
        monkeypatch.setenv(_matmul.ENV, env)
        results[env] = ours = _run(hidden, weight, bias, labels, **kw)
        names = ("loss", "hidden", "weight", "bias")
        for name, got, want in zip(names, ours, [ref_loss, *ref_grads], strict=True):
            assert_close(got, want, name=f"{env} {name}", **TOL)
        if env == "onednn":  # exactly the products' FLOPs, in many slices
            assert onednn.flops == products * 2 * valid * 12 * 50, onednn.flops
            assert onednn.count > 10 * -(-valid // 16), onednn.count
    for a, b in zip(results["onednn"], results["aten"], strict=True):
        assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_cpu_fp32_uses_onednn_and_the_environment_selects_aten(monkeypatch, onednn):
    hidden, weight, bias, labels = make_inputs(20, 8, 30, seed=2)
    for env, used in (("onednn", True), ("aten", False)):
        monkeypatch.setenv(_matmul.ENV, env)
        onednn.count = 0
        with_grad = weight.clone().requires_grad_()
        linear_cross_entropy(hidden, with_grad, labels, bias=bias).backward()
        assert (onednn.count > 0) == used, (env, onednn.count)
    monkeypatch.setenv(_matmul.ENV, "mkl")
    with pytest.raises(ValueError, match=r"CHUNKED_LOSS_CPU_MATMUL must be one of .*'mkl'"):
        linear_cross_entropy(hidden, weight, labels)


@pytest.mark.parametrize("gif", [True, False], ids=["grad_in_forward", "recompute"])
def test_a_dispatch_mode_sees_aten_matmuls(onednn, gif):
    """torch's FlopCounterMode counts the loss: 3 products (recompute: 4) of [M, H] x [H, V]."""
    hidden, weight, bias, labels = make_inputs(40, 8, 30, seed=8)
    valid = int((labels != -100).sum())
    with FlopCounterMode(display=False) as flops, MatmulCounter() as ours:
        _run(hidden, weight, bias, labels, chunk_size=7, grad_in_forward=gif)
    product = 2 * valid * 8 * 30
    assert flops.get_total_flops() == ours.flops == (3 if gif else 4) * product
    assert onednn.count == 0


def test_backend_choice():
    weight = torch.randn(30, 8)
    assert _matmul.backend(weight) == "onednn"
    assert _matmul.backend(weight.t().contiguous().t()) == "aten"  # strided weight
    assert _matmul.backend(weight.bfloat16()) == "aten"  # torch already routes bf16 to oneDNN
    assert _matmul.backend(weight.double()) == "aten"  # oneDNN has no fp64
    assert _matmul.backend(torch.randn(30, 0)) == "aten"  # no primitive for H = 0


def test_strided_bias_and_weight(monkeypatch):
    """oneDNN misreads a strided bias: it is made contiguous first. A strided weight takes the
    aten backend. Both give the reference values and gradients."""
    hidden, weight, bias, labels = make_inputs(30, 8, 40, seed=4)
    ref_loss, ref_grads = reference(hidden, weight, labels, bias=bias)
    for gif in (True, False):
        b = torch.stack([bias, torch.zeros_like(bias)], 1)[:, 0].requires_grad_()
        w = weight.t().contiguous().t().requires_grad_()  # strided
        h = hidden.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, labels, bias=b, grad_in_forward=gif)
        loss.backward()
        assert not b.is_contiguous() and not w.is_contiguous()
        for name, got, want in zip(
            ("loss", "hidden", "weight", "bias"),
            (loss, h.grad, w.grad, b.grad),
            [ref_loss, *ref_grads],
            strict=True,
        ):
            assert_close(got, want, name=name, **TOL)
        # the strided bias alone, with the oneDNN weight
        b2 = torch.stack([bias, torch.zeros_like(bias)], 1)[:, 0]
        assert_close(
            linear_cross_entropy(hidden, weight, labels, bias=b2, grad_in_forward=gif),
            ref_loss,
            **TOL,
        )


@pytest.mark.usefixtures("fresh_probe")
def test_without_onednn_aten_runs_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(_compat, "onednn_linear", lambda: None)
    hidden, weight, bias, labels = make_inputs(25, 8, 30, seed=6)
    ref_loss, _ = reference(hidden, weight, labels, bias=bias)
    with caplog.at_level(logging.INFO, logger="chunked_loss"):
        for _ in range(2):
            assert _matmul.backend(weight) == "aten"
            assert_close(linear_cross_entropy(hidden, weight, labels, bias=bias), ref_loss, **TOL)
    messages = [r.getMessage() for r in caplog.records if r.name == "chunked_loss"]
    assert len(messages) == 1 and "has no oneDNN" in messages[0], messages


@pytest.mark.usefixtures("fresh_probe")
def test_a_failing_probe_means_aten(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("simulated: could not create a primitive")

    monkeypatch.setattr(_compat, "onednn_linear", lambda: broken)
    with caplog.at_level(logging.INFO, logger="chunked_loss"):
        assert _matmul.backend(torch.randn(3, 2)) == "aten"
    assert "simulated: could not create a primitive" in caplog.text
