"""Bad input raises ValueError / TypeError naming what was expected and what came."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chunked_loss import (
    LinearCrossEntropy,
    chunked_cross_entropy,
    global_num_valid_tokens,
    linear_cross_entropy,
)

H, V, N = 8, 11, 6


def good():
    return torch.randn(N, H), torch.randn(V, H), torch.randint(0, V, (N,))


def call(**overrides):
    hidden, weight, labels = good()
    args = {"hidden": hidden, "weight": weight, "labels": labels} | overrides
    kw = {k: v for k, v in args.items() if k not in ("hidden", "weight", "labels")}
    return linear_cross_entropy(args["hidden"], args["weight"], args["labels"], **kw)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (
            {"labels": torch.zeros(N + 1, dtype=torch.long)},
            ValueError,
            r"labels shape \(7,\) does not match.*\(6,\)",
        ),
        (
            {"hidden": torch.randn(N, H + 1)},
            ValueError,
            r"hidden width 9 does not match weight \[V, H\] = \(11, 8\)",
        ),
        ({"hidden": torch.randn(N)}, ValueError, r"\[N, H\] or \[B, S, H\].*got shape \(6,\)"),
        (
            {"weight": torch.randn(V, H, 1)},
            ValueError,
            r"weight must be \[V, H\], got shape \(11, 8, 1\)",
        ),
        (
            {"bias": torch.randn(V + 1)},
            ValueError,
            r"bias must be \[V\] = \(11,\), got shape \(12,\)",
        ),
        (
            {"labels": torch.tensor([0, 1, 2, 11, 3, -100])},
            ValueError,
            r"in \[0, 11\) or equal ignore_index=-100.*first 11",
        ),
        ({"labels": torch.tensor([0, -1, 2, 3, 3, 3])}, ValueError, r"first -1"),
        (
            {"labels": torch.zeros(N)},
            ValueError,
            "labels must be an integer tensor, got dtype torch.float32",
        ),
        ({"chunk_size": 0}, ValueError, "chunk_size must be positive, got 0"),
        ({"chunk_size": -3}, ValueError, "chunk_size must be positive, got -3"),
        ({"chunk_size": 2.5}, TypeError, "chunk_size must be an int or None, got float"),
        ({"compiled": "yes"}, TypeError, "compiled must be a bool or None, got str"),
        (
            {"reduction": "avg"},
            ValueError,
            r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'",
        ),
        ({"label_smoothing": 1.5}, ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
        ({"num_valid_tokens": -1}, ValueError, "num_valid_tokens must be >= 0, got -1"),
        (
            {"num_valid_tokens": 2.0},
            TypeError,
            "num_valid_tokens must be an int or a one-element integer tensor, got float",
        ),
        (
            {"num_valid_tokens": torch.tensor([1.0])},
            TypeError,
            "one-element integer tensor, got a torch.float32",
        ),
        (
            {"weight": torch.randn(V, H, dtype=torch.float64)},
            ValueError,
            "weight dtype torch.float64 differs from hidden dtype torch.float32",
        ),
        ({"hidden": [[1.0]]}, TypeError, "hidden must be a torch.Tensor, got list"),
        ({"grad_in_forward": 1}, TypeError, "grad_in_forward must be a bool or None, got int"),
        (
            {"grad_in_forward": True, "reduction": "none"},
            ValueError,
            r'grad_in_forward=True needs a scalar loss \(reduction "mean" or "sum"\)',
        ),
    ],
)
def test_linear_cross_entropy_rejects(overrides, error, match):
    with pytest.raises(error, match=match):
        call(**overrides)


def test_ignore_index_label_is_not_out_of_range():
    hidden, weight, _ = good()
    labels = torch.tensor([0, -7, 1, -7, 2, 3])
    assert torch.isfinite(linear_cross_entropy(hidden, weight, labels, ignore_index=-7))


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (
            {"labels": torch.zeros(5, dtype=torch.long)},
            ValueError,
            r"labels shape \(5,\) does not match.*\[\.\.\., V\]",
        ),
        ({"labels": torch.full((N,), V)}, ValueError, r"in \[0, 11\)"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be positive"),
        ({"reduction": "mean_all"}, ValueError, "reduction must be one of"),
        (
            {"logits": torch.zeros(N, V, dtype=torch.long)},
            ValueError,
            "logits must be a floating-point tensor",
        ),
    ],
)
def test_chunked_cross_entropy_rejects(kw, error, match):
    args = {"logits": torch.randn(N, V), "labels": torch.randint(0, V, (N,))} | kw
    with pytest.raises(error, match=match):
        chunked_cross_entropy(args.pop("logits"), args.pop("labels"), **args)


def test_module_and_helper_reject():
    with pytest.raises(TypeError, match=r"lm_head must be an nn\.Linear, got Conv1d"):
        LinearCrossEntropy(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="reduction must be one of"):
        LinearCrossEntropy.create(4, 5, reduction="max")
    with pytest.raises(
        TypeError, match=r"labels\[1\] must be an integer tensor, got torch.float32"
    ):
        global_num_valid_tokens([torch.zeros(2, dtype=torch.long), torch.zeros(2)])
    with pytest.raises(ValueError, match="non-empty sequence"):
        global_num_valid_tokens([])
