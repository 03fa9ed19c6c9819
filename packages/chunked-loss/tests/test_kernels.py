"""The compiled per-chunk kernels: agreement with the eager ones, no recompilation across steps,
the logged-once exact fallback, the chunk size chosen from the memory budget, and the number of
matmuls per chunk of each path."""

from __future__ import annotations

import logging

import pytest
import torch
from _count import MatmulCounter
from _reference import make_inputs, reference
from torch._dynamo.utils import counters

from chunked_loss import _checks, _compat, _kernels, linear_chunk_bytes, linear_cross_entropy
from dist_testkit import assert_close

TOL = {"rtol": 1e-4, "atol": 1e-5}


def _loss_and_grads(hidden, weight, bias, labels, **kw):
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = linear_cross_entropy(leaves[0], leaves[1], labels, bias=leaves[2], **kw)
    loss.backward(torch.full_like(loss, 0.7))
    return [loss.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("gif", [True, False], ids=["grad_in_forward", "recompute"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_compiled_and_eager_kernels_agree(gif, label_smoothing):
    hidden, weight, bias, labels = make_inputs(150, 24, 700, seed=3)
    kw = {"chunk_size": 64, "grad_in_forward": gif, "label_smoothing": label_smoothing}
    compiled = _loss_and_grads(hidden, weight, bias, labels, compiled=True, **kw)
    eager = _loss_and_grads(hidden, weight, bias, labels, compiled=False, **kw)
    for name, c, e in zip(("loss", "hidden", "weight", "bias"), compiled, eager, strict=True):
        assert_close(c, e, rtol=1e-5, atol=1e-7, name=name)


def test_no_recompilation_across_steps_with_changing_valid_tokens():
    """After one step, three more with other token counts and ignore fractions (so other chunk
    tails) on both paths compile nothing new: any recompilation raises here."""
    hidden, weight, bias, labels = make_inputs(40, 8, 60, seed=5, ignore_frac=0.2)
    for gif in (True, False):
        _loss_and_grads(
            hidden, weight, bias, labels, chunk_size=16, grad_in_forward=gif, compiled=True
        )
    graphs = counters["stats"]["unique_graphs"]
    tails = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step, (n, frac) in enumerate([(45, 0.1), (52, 0.5), (37, 0.3)]):
            hidden, weight, bias, labels = make_inputs(n, 8, 60, seed=10 + step, ignore_frac=frac)
            tails.append(int((labels != -100).sum()) % 16)
            for gif in (True, False):
                ours = _loss_and_grads(
                    hidden, weight, bias, labels, chunk_size=16, grad_in_forward=gif, compiled=True
                )
                ref_loss, ref_grads = reference(
                    hidden, weight, labels, bias=bias, grad_out=torch.tensor(0.7)
                )
                assert_close(ours[0], ref_loss, **TOL)
                for g, rg in zip(ours[1:], ref_grads, strict=True):
                    assert_close(g, rg, **TOL)
    assert counters["stats"]["unique_graphs"] == graphs
    assert len(set(tails)) == 3 and 1 not in tails, tails  # really other tails (2+ rows)


@pytest.fixture
def fresh_fallback_state(monkeypatch):
    monkeypatch.setattr(_kernels, "_unavailable", {})


def _failing_compile():
    def boom(*args):
        raise _compat.compile_errors()[0]("simulated: no C++ compiler")

    return boom, boom


@pytest.mark.usefixtures("fresh_fallback_state")
def test_compile_failure_falls_back_exactly_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(_kernels, "_compiled", _failing_compile)
    hidden, weight, bias, labels = make_inputs(30, 8, 20, seed=7)
    ref_loss, ref_grads = reference(hidden, weight, labels, bias=bias, grad_out=torch.tensor(0.7))
    with caplog.at_level(logging.WARNING, logger="chunked_loss"):
        for gif in (True, False, True):
            ours = _loss_and_grads(hidden, weight, bias, labels, chunk_size=7, grad_in_forward=gif)
            assert_close(ours[0], ref_loss, **TOL)
            for g, rg in zip(ours[1:], ref_grads, strict=True):
                assert_close(g, rg, **TOL)
    messages = [r.getMessage() for r in caplog.records if r.name == "chunked_loss"]
    assert len(messages) == 1, messages
    assert "unavailable on cpu" in messages[0] and "simulated: no C++ compiler" in messages[0]
    with pytest.raises(RuntimeError, match=r"compiled=True, but .*simulated: no C\+\+ compiler"):
        _loss_and_grads(hidden, weight, bias, labels, compiled=True)


@pytest.mark.usefixtures("fresh_fallback_state")
def test_compiled_true_raises_on_compile_failure(monkeypatch):
    monkeypatch.setattr(_kernels, "_compiled", _failing_compile)
    hidden, weight, bias, labels = make_inputs(9, 4, 6)
    with pytest.raises(RuntimeError, match=r"torch\.compile failed on cpu: simulated"):
        _loss_and_grads(hidden, weight, bias, labels, compiled=True)


@pytest.mark.usefixtures("fresh_fallback_state")
def test_compile_disabled_uses_eager_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(_compat, "compile_disabled", lambda: True)
    monkeypatch.setattr(_kernels, "_compiled", _failing_compile)  # must not even be tried
    hidden, weight, bias, labels = make_inputs(12, 4, 9)
    with caplog.at_level(logging.WARNING, logger="chunked_loss"):
        _loss_and_grads(hidden, weight, bias, labels, chunk_size=5)
        _loss_and_grads(hidden, weight, bias, labels, chunk_size=5)
    messages = [r.getMessage() for r in caplog.records if r.name == "chunked_loss"]
    assert len(messages) == 1 and "TORCH_COMPILE_DISABLE" in messages[0], messages


def test_chunk_size_from_the_memory_budget(monkeypatch):
    """The formula's values, the largest chunk that fits, and its use when chunk_size=None."""
    budget = _checks.CHUNK_BUDGET_BYTES
    assert budget == 256 << 20
    assert _checks.linear_chunk_size(248320, 1024, torch.float32) == 269
    assert _checks.linear_chunk_size(248320, 1024, torch.bfloat16) == 179
    for v, h, dtype, per_row in [
        (248320, 3072, torch.float32, 4 * 248320 + 4 * 3072),
        (32000, 512, torch.bfloat16, 6 * 32000 + 6 * 512),
    ]:
        rows = _checks.linear_chunk_size(v, h, dtype)
        assert rows * per_row <= budget < (rows + 1) * per_row
    # chunk_size=None follows the budget: 10 rows of V = 50, H = 8 fp32 → 37 tokens in 4 chunks
    monkeypatch.setattr(_checks, "CHUNK_BUDGET_BYTES", 10 * (4 * 50 + 4 * 8) + 5)
    hidden, weight, _, labels = make_inputs(37, 8, 50, ignore_frac=0.0)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with MatmulCounter() as count:
        linear_cross_entropy(h, w, labels, grad_in_forward=True, compiled=False)
    assert count.count == 3 * 4


def test_chunk_bytes_are_one_chunk_of_the_rows_at_most():
    """The working set one call holds: a full chunk at the budget where the rows exceed it, the
    rows' own bytes where they are fewer (a small vocabulary or a short row)."""
    full = 269 * (4 * 248320 + 4 * 1024)
    assert linear_chunk_bytes(10_000, 248320, 1024, torch.float32) == full
    assert full <= _checks.CHUNK_BUDGET_BYTES
    assert linear_chunk_bytes(1024, 6144, 512, torch.bfloat16) == 1024 * (6 * 6144 + 6 * 512)
    assert linear_chunk_bytes(0, 6144, 512, torch.float32) == 0


@pytest.mark.parametrize("bias", [True, False])
def test_matmuls_per_chunk(bias):
    """Gradient in forward: 3 matmuls per chunk, none in backward; recompute: 1 + 3. Ignored
    tokens are not computed: 30 valid of 40 tokens at chunk 8 are 4 chunks."""
    hidden, weight, b, labels = make_inputs(40, 8, 21, bias=bias, ignore_frac=0.0)
    labels[::4] = -100
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
    for gif, forward, backward in [(True, 12, 0), (False, 4, 12)]:
        with MatmulCounter() as fwd:
            loss = linear_cross_entropy(
                *leaves, labels, bias=b, chunk_size=8, grad_in_forward=gif, compiled=False
            )
        with MatmulCounter() as bwd:
            loss.backward()
        assert (fwd.count, bwd.count) == (forward, backward), gif


def test_dispatch_mode_uses_eager_and_logs_once(monkeypatch, caplog):
    """Dynamo does not compile under a TorchDispatchMode (a FLOP counter, say): auto mode runs
    the exact eager kernels and says so once; compiled=True raises."""
    monkeypatch.setattr(_kernels, "_logged_dispatch_mode", [])
    hidden, weight, bias, labels = make_inputs(12, 4, 9)
    ref_loss, _ = reference(hidden, weight, labels, bias=bias)
    with caplog.at_level(logging.WARNING, logger="chunked_loss"), MatmulCounter():
        for _ in range(2):
            loss = linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_size=5)
            assert_close(loss, ref_loss, **TOL)
        with pytest.raises(RuntimeError, match="TorchDispatchMode is active"):
            linear_cross_entropy(hidden, weight, labels, bias=bias, compiled=True)
    messages = [r.getMessage() for r in caplog.records if r.name == "chunked_loss"]
    assert len(messages) == 1 and "TorchDispatchMode" in messages[0], messages
