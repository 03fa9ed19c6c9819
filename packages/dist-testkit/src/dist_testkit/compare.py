"""Compare a sharded / chunked / parallel result with its single-process reference.

Failures print the worst element (index, both values, absolute and relative error) so that a
mismatch can be diagnosed from the log of one CI run. DTensors are gathered with
``full_tensor()`` before comparison, so a sharded parameter's gradient compares directly with the
unsharded one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["assert_close", "assert_grads_close", "full"]


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor is gathered, anything else is returned as is."""
    to_full = getattr(t, "full_tensor", None)
    return to_full() if callable(to_full) else t


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    name: str = "tensor",
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise (in float64).

    Shapes must match exactly. The error message names the worst element.
    """
    actual, expected = full(actual).detach(), full(expected).detach()
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    if actual.numel() == 0:
        return
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    if not torch.equal(torch.isnan(a), torch.isnan(e)):
        raise AssertionError(
            f"{name}: NaN pattern differs ({int(torch.isnan(a).sum())} NaN in actual, {int(torch.isnan(e).sum())} expected)"
        )
    diff = (a - e).abs().nan_to_num(0.0)
    excess = diff - (atol + rtol * e.abs().nan_to_num(0.0))
    worst = int(excess.argmax())
    if excess.reshape(-1)[worst] > 0:
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
        bad = int((excess > 0).sum())
        raise AssertionError(
            f"{name}: {bad} of {a.numel()} elements differ beyond atol={atol}, rtol={rtol}; "
            f"worst at {idx}: actual {a.reshape(-1)[worst].item():.8g}, expected {e.reshape(-1)[worst].item():.8g}, "
            f"abs err {diff.reshape(-1)[worst].item():.3g}, max abs err {diff.max().item():.3g}"
        )


def assert_grads_close(
    actual: nn.Module | Mapping[str, torch.Tensor | None],
    expected: nn.Module | Mapping[str, torch.Tensor | None],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Compare the gradients of two modules (or name → grad mappings) parameter by parameter.

    Both sides must have the same parameter names; a ``None`` gradient on one side only is an
    error (a missing gradient is exactly the kind of bug these tests exist to catch).
    """
    a, e = _grads(actual), _grads(expected)
    if a.keys() != e.keys():
        raise AssertionError(
            f"parameter names differ: only actual {sorted(a.keys() - e.keys())}, only expected {sorted(e.keys() - a.keys())}"
        )
    for name in a:
        ga, ge = a[name], e[name]
        if ga is None or ge is None:
            if ga is not ge:
                raise AssertionError(
                    f"{name}.grad: actual is {'None' if ga is None else 'set'}, expected is {'None' if ge is None else 'set'}"
                )
            continue
        assert_close(ga, ge, rtol=rtol, atol=atol, name=f"{name}.grad")


def _grads(obj: nn.Module | Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    if isinstance(obj, nn.Module):
        return {n: p.grad for n, p in obj.named_parameters()}
    return dict(obj)
