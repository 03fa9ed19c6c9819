"""assert_close / assert_grads_close report the worst element and catch missing gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_testkit import assert_close, assert_grads_close


def test_assert_close_passes_and_names_worst_element():
    a = torch.zeros(3, 4)
    assert_close(a, a.clone())
    b = a.clone()
    b[2, 1] = 0.5
    b[0, 0] = 1e-7
    with pytest.raises(AssertionError, match=r"1 of 12 elements.*worst at \(2, 1\).*expected 0.5"):
        assert_close(a, b, name="x")


def test_assert_close_shape_and_nan():
    with pytest.raises(AssertionError, match="shape"):
        assert_close(torch.zeros(2), torch.zeros(3))
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(torch.tensor([float("nan")]), torch.tensor([0.0]))


def test_assert_grads_close_catches_none_and_mismatch():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 2)
    a(x).sum().backward()
    with pytest.raises(AssertionError, match=r"bias\.grad: actual is set, expected is None"):
        assert_grads_close(a, {"weight": a.weight.grad, "bias": None})
    b(x).sum().backward()
    assert_grads_close(a, b)
    b.weight.grad[0, 0] += 1.0
    with pytest.raises(AssertionError, match=r"weight\.grad"):
        assert_grads_close(a, b)
