"""The chunk matmuls' two CPU backends (``_matmul``): oneDNN (the CPU fp32 default) and aten.

Both against the float64 reference and each other, with the oneDNN products cut into many
slices (``SLICE_BYTES`` shrunk) so the slice loops really run, on both loss paths; exactly the
FLOPs of the three products either way; the backend choice (environment, dtype, layout) and the
logged fallback when oneDNN is missing; a strided bias (which oneDNN misreads) made safe."""

from __future__ import annotations

import logging

import pytest
import torch
from _count import MatmulCounter
from _reference import make_inputs, reference

from chunked_loss import _compat, _matmul, linear_cross_entropy
from dist_testkit import assert_close

TOL = {"rtol": 1e-4, "atol": 1e-5}
ONEDNN = torch.ops.mkldnn._linear_pointwise


def _run(hidden, weight, bias, labels, **kw):
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    with MatmulCounter() as count:
        loss = linear_cross_entropy(leaves[0], leaves[1], labels, bias=leaves[2], **kw)
        loss.backward(torch.full_like(loss, 0.7))
    return [loss.detach()] + [t.grad for t in leaves], count


@pytest.fixture
def fresh_probe():
    _matmul._onednn.cache_clear()
    yield
    _matmul._onednn.cache_clear()


def _uses(count_ops, monkeypatch, env, hidden, weight, bias, labels):
    """The matmul ops one call dispatches with ``CHUNKED_LOSS_CPU_MATMUL=env``."""
    seen = set()

    class Ops(MatmulCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in count_ops:
                seen.add(func.overloadpacket)
            return super().__torch_dispatch__(func, types, args, kwargs)

    monkeypatch.setenv(_matmul.ENV, env)
    with Ops():
        linear_cross_entropy(hidden, weight.clone().requires_grad_(), labels, bias=bias).backward()
    return seen


@pytest.mark.parametrize("gif", [True, False], ids=["grad_in_forward", "recompute"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_backends_match_the_reference_with_many_slices(monkeypatch, gif, smoothing):
    # 45 valid rows in chunks of 16 (tail 13); at 16 rows a 200-byte slice is 3 logits columns
    # and, at H = 12, 4 weight-gradient rows: 17 and 13 slices of V = 50, the last ones short.
    monkeypatch.setattr(_matmul, "SLICE_BYTES", 200)
    hidden, weight, bias, labels = make_inputs(60, 12, 50, seed=11, ignore_frac=0.25)
    valid = int((labels != -100).sum())
    kw = {"chunk_size": 16, "grad_in_forward": gif, "label_smoothing": smoothing}
    ref_loss, ref_grads = reference(
        hidden, weight, labels, bias=bias, label_smoothing=smoothing, grad_out=torch.tensor(0.7)
    )
    results = {}
    for env in _matmul.BACKENDS:
        monkeypatch.setenv(_matmul.ENV, env)
        ours, count = _run(hidden, weight, bias, labels, **kw)
        for name, got, want in zip(
            ("loss", "hidden", "weight", "bias"), ours, [ref_loss, *ref_grads], strict=True
        ):
            assert_close(got, want, name=f"{env} {name}", **TOL)
        products = 3 if gif else 4
        assert count.flops == products * 2 * valid * 12 * 50, (env, count.flops)
        results[env] = (ours, count.count)
    chunks = -(-valid // 16)
    assert results["aten"][1] == products * chunks
    assert results["onednn"][1] > 10 * chunks  # the slice loops ran
    for a, b in zip(results["onednn"][0], results["aten"][0], strict=True):
        assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_cpu_fp32_uses_onednn_and_the_environment_selects_aten(monkeypatch):
    hidden, weight, bias, labels = make_inputs(20, 8, 30, seed=2)
    aten = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_}
    ops = aten | {ONEDNN}
    assert _uses(ops, monkeypatch, "onednn", hidden, weight, bias, labels) == {ONEDNN}
    assert not _uses(ops, monkeypatch, "aten", hidden, weight, bias, labels) & {ONEDNN}
    monkeypatch.setenv(_matmul.ENV, "mkl")
    with pytest.raises(ValueError, match=r"CHUNKED_LOSS_CPU_MATMUL must be one of .*'mkl'"):
        linear_cross_entropy(hidden, weight, labels)


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
