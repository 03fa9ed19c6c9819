"""The TransformerEngine expert backend on CPU, against a stand-in with TE's zero-row hazard.

``fake_te.GroupedLinear`` has TE's interface and leaves NaN in the weight gradient of an expert
that got no rows (TE's uninitialised buffer). Through ``expert_backend="te"`` the results equal
the torch backend exactly and idle experts get zero gradients; calling the stand-in directly
shows the NaN (negative control). The real TE runs in test_gpu.py.
"""

from __future__ import annotations

import importlib.util
import sys

import fake_te
import pytest
import torch
from helpers import IDLE_EXPERT, tiny_moe, tokens

from dist_testkit import assert_close, assert_grads_close
from moe_parallel import expert_swiglu, te_backend

HAS_TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.fixture
def stand_in(monkeypatch):
    for name, module in fake_te.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(te_backend, "TE_DEVICE_TYPES", ("cuda", "cpu"))
    te_backend._shell.cache_clear()
    te_backend.te_available.cache_clear()
    yield
    te_backend._shell.cache_clear()
    te_backend.te_available.cache_clear()


def _weights(seed=0, experts=4, hidden=16, inter=8):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3).requires_grad_(),
        (torch.randn(experts, hidden, inter, generator=g) * 0.3).requires_grad_(),
    ]


@pytest.mark.parametrize("counts", [[5, 0, 3, 4], [0, 0, 7, 0], [2, 2, 2, 2]])
def test_te_backend_equals_torch_backend_and_zeroes_idle_grads(stand_in, counts):
    x = torch.randn(sum(counts), 16, generator=torch.Generator().manual_seed(1))
    counts_E = torch.tensor(counts)
    ours, ref = _weights(), _weights()
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = expert_swiglu(x_ours, counts_E, *ours, backend="te")
    y_ref = expert_swiglu(x_ref, counts_E, *ref, backend="torch")
    assert_close(y, y_ref, name="output")
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    assert_close(x_ours.grad, x_ref.grad, name="x.grad")
    for name, a, b in zip(("gate_up", "down"), ours, ref, strict=True):
        assert a.grad is not None, name
        assert torch.isfinite(a.grad).all(), f"{name}: idle-expert garbage reached the parameter"
        assert_close(a.grad, b.grad, name=name)
        for e, rows in enumerate(counts):
            if rows == 0:
                assert torch.count_nonzero(a.grad[e]) == 0, (name, e)


def test_stand_in_alone_leaves_garbage_for_idle_experts(stand_in):
    """Negative control: without the hook the idle expert's gradient is the buffer's garbage."""
    layer = fake_te.GroupedLinear(3, 16, 8, bias=False, device="cpu")
    torch.nn.init.normal_(layer.weight0)
    torch.nn.init.normal_(layer.weight1)
    torch.nn.init.normal_(layer.weight2)
    layer(torch.randn(6, 16), [4, 0, 2]).sum().backward()
    assert torch.isnan(layer.weight1.grad).all()
    assert torch.isfinite(layer.weight0.grad).all()


def test_shell_owns_no_parameters_and_keeps_no_weights(stand_in):
    w = _weights()[0]
    expert_swiglu(torch.randn(3, 16), torch.tensor([1, 1, 1, 0]), w, _weights()[1], backend="te")
    shell = te_backend._shell(4, 16, 16, torch.float32, "cpu")
    assert list(shell.parameters()) == []
    assert not any(name.startswith("weight") for name in vars(shell)), vars(shell).keys()


def test_moe_with_te_backend_equals_torch_backend(stand_in):
    """The whole block (router, idle expert 7, shared expert): outputs and every grad."""
    ref = tiny_moe()
    ref.experts.backend = "torch"
    ours = tiny_moe()
    ours.experts.backend = "te"
    x = tokens(2, 5, seed=3)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(x_ref), ours(x_ours)
    assert ref.stats.tokens_per_expert[IDLE_EXPERT] == 0
    assert_close(y, y_ref, name="output")
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert_close(x_ours.grad, x_ref.grad, name="x.grad")
    assert_grads_close(ours, ref)
    assert torch.count_nonzero(ours.experts.gate_up_proj.grad[IDLE_EXPERT]) == 0


def test_auto_picks_te_only_where_it_runs(stand_in, monkeypatch):
    gate_up, down = _weights()
    x, counts = torch.randn(3, 16), torch.tensor([1, 2, 0, 0])
    expert_swiglu(x, counts, gate_up, down, backend="auto")
    assert te_backend._shell.cache_info().currsize == 2  # both projections went through TE
    monkeypatch.setattr(te_backend, "TE_DEVICE_TYPES", ("cuda",))
    te_backend._shell.cache_clear()
    expert_swiglu(x, counts, gate_up, down, backend="auto")
    assert te_backend._shell.cache_info().currsize == 0  # CPU rows: torch


def test_zero_rows_take_the_exact_loop_with_zero_grads():
    """No rows never reach TE (so this runs even without it, on any device)."""
    gate_up, down = _weights()
    y = expert_swiglu(
        torch.zeros(0, 16), torch.zeros(4, dtype=torch.long), gate_up, down, backend="te"
    )
    assert y.shape == (0, 16)
    y.sum().backward()
    assert gate_up.grad is not None and torch.count_nonzero(gate_up.grad) == 0
    assert down.grad is not None and torch.count_nonzero(down.grad) == 0


def test_bad_backend_and_device_are_refused():
    gate_up, down = _weights()
    x, counts = torch.randn(2, 16), torch.tensor([1, 1, 0, 0])
    with pytest.raises(ValueError, match="backend must be one of"):
        expert_swiglu(x, counts, gate_up, down, backend="cutlass")
    with pytest.raises(ValueError, match="expert_backend must be one of"):
        tiny_moe().experts.__class__(16, 8, 8, backend="cutlass")
    with pytest.raises(ValueError, match="CUDA tensors, got rows on cpu"):
        expert_swiglu(x, counts, gate_up, down, backend="te")


@pytest.mark.skipif(
    HAS_TE, reason="transformer_engine is installed: the missing-package error cannot occur"
)
def test_missing_transformer_engine_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setattr(te_backend, "TE_DEVICE_TYPES", ("cuda", "cpu"))
    te_backend._shell.cache_clear()
    te_backend.te_available.cache_clear()
    gate_up, down = _weights()
    assert not te_backend.te_available()  # so "auto" takes torch, and "te" raises:
    te_backend.te_available.cache_clear()
    with pytest.raises(ImportError, match=r"moe-parallel\[te\]"):
        expert_swiglu(torch.randn(2, 16), torch.tensor([1, 1, 0, 0]), gate_up, down, backend="te")
