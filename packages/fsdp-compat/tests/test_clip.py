"""``clip_grad_norm`` in one process: the same norm and clipped gradients as torch's
``clip_grad_norm_``, measuring without clipping, and refusals of meaningless limits. (Several
meshes: ``check_expert_mesh_and_clip`` in test_fsdp2_dist.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_compat import clip_grad_norm


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((3, 4), (5,), (0,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_equals_torch(max_norm):
    ours, theirs = _params(), _params()
    expected = float(torch.nn.utils.clip_grad_norm_(theirs, max_norm))
    assert math.isclose(clip_grad_norm(ours, max_norm), expected, rel_tol=1e-6)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_none_only_measures():
    params, before = _params(), [p.grad.clone() for p in _params()]
    norm = clip_grad_norm(params, None)
    expected = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in before])))
    assert math.isclose(norm, expected, rel_tol=1e-6)
    for p, g in zip(params, before, strict=True):
        assert torch.equal(p.grad, g)


def test_non_finite_norm_leaves_gradients():
    params = _params()
    params[0].grad[0, 0] = float("nan")
    before = [p.grad.clone() for p in params]
    assert math.isnan(clip_grad_norm(params, 0.1))
    for p, g in zip(params, before, strict=True):
        assert torch.equal(p.grad.nan_to_num(), g.nan_to_num())


@pytest.mark.parametrize(("bad", "error"), [(0.0, ValueError), (-1.0, ValueError),
                                            (float("nan"), ValueError), ("1", TypeError),
                                            (True, TypeError)])  # fmt: skip
def test_refuses_bad_limits(bad, error):
    with pytest.raises(error, match="max_norm must be"):
        clip_grad_norm(_params(), bad)
