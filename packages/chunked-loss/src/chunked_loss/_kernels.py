"""The per-chunk elementwise work on one fp32 [C, V] block of logits, compiled or eager.

Both loss paths do, per chunk of logits ``z`` (rows = tokens, columns = this process's vocabulary
slice), two things besides the matmuls:

- ``row_stats``: ``max_C = max_v z``, ``sumexp_C = Σ_v exp(z − max)``, ``target_C = z[col]``,
  ``zsum_C = Σ_v z`` (so ``lse = max + log sumexp``, combined over TP shards when split);
- ``dlogits_``: in place, ``z ← scale · (exp(z − lse) − ε/V − tw · [v = col])`` with
  ``tw = (1 − ε)`` where this slice holds the target (0 elsewhere), i.e. ``scale · ∂loss/∂z``.

``softmax_dlogits_`` is both for a whole vocabulary (no collective in between).

The compiled versions (``torch.compile``, Inductor, ``dynamic=True``: one graph for every chunk
and tail length and every V, recompiled only for Inductor's own size classes — a 1-row or
1-column block, a reduction of at most 4096 columns) read the block three times and write it
once, into the block itself (Inductor stores a graph input's ``copy_`` straight into it), so no
second [C, V] buffer exists. The eager versions are the same formulas as separate torch ops
(``dlogits_`` and ``softmax_dlogits_`` in place, ``row_stats`` with one temporary block for the
shifted exponentials). Both are exact to fp32 rounding; which runs is the caller's ``compiled``
choice: ``None`` compiles where Inductor works and otherwise uses the eager kernels, logging the
reason once per device type; ``True`` raises instead; ``False`` is always eager. A compilation
that fails raises before the compiled kernel touches its inputs, so rerunning eagerly is exact.
"""

from __future__ import annotations

import functools
import logging

import torch

from chunked_loss import _compat

__all__ = ["dlogits_", "row_stats", "softmax_dlogits_", "use_compiled"]

_log = logging.getLogger("chunked_loss")

# device type -> why the compiled kernels cannot be used there (logged once, when first set)
_unavailable: dict[str, str] = {}
_logged_dispatch_mode: list[bool] = []  # non-empty once that fallback was logged


def _stats(logits_CV: torch.Tensor, col_C: torch.Tensor):
    max_C = logits_CV.amax(dim=1)
    sumexp_C = torch.exp(logits_CV - max_C[:, None]).sum(dim=1)
    target_C = logits_CV.gather(1, col_C[:, None]).squeeze(1)
    return max_C, sumexp_C, target_C, logits_CV.sum(dim=1)


def _dlogits(logits_CV, lse_C, col_C, tw_C, scale_C, smooth) -> None:
    columns_V = torch.arange(logits_CV.shape[1], device=logits_CV.device)
    onehot_CV = columns_V[None, :] == col_C[:, None]
    dz_CV = torch.exp(logits_CV - lse_C[:, None]) - smooth
    dz_CV = dz_CV - torch.where(onehot_CV, tw_C[:, None], 0.0)
    logits_CV.copy_(dz_CV * scale_C[:, None])


@functools.cache
def _compiled():
    options = {"dynamic": True, "fullgraph": True}
    return torch.compile(_stats, **options), torch.compile(_dlogits, **options)


def use_compiled(choice: bool | None, device: torch.device) -> bool:
    """Resolve ``compiled`` for tensors on ``device`` (see the module docstring)."""
    if choice is False:
        return False
    if _compat.dispatch_mode_active():
        # Dynamo does not compile under a TorchDispatchMode; the eager kernels are exact.
        if choice:
            raise RuntimeError(
                "compiled=True, but a TorchDispatchMode is active and torch.compile does not run "
                "under one; use compiled=None or False"
            )
        if not _logged_dispatch_mode:
            _logged_dispatch_mode.append(True)
            _log.warning(
                "chunked_loss: a TorchDispatchMode is active, so the compiled per-chunk kernels "
                "cannot run; using the exact eager kernels while it is"
            )
        return False
    if device.type not in _unavailable:
        if _compat.compile_disabled():
            _unavailable[device.type] = "torch.compile is disabled (TORCH_COMPILE_DISABLE=1)"
        elif not _compat.inductor_supported():
            _unavailable[device.type] = "Inductor does not support this Python or platform"
        else:
            return True
        if choice is None:
            _log_fallback(device.type)
    if choice:
        raise RuntimeError(
            f"compiled=True, but the compiled kernels cannot run on {device.type}: "
            f"{_unavailable[device.type]}; use compiled=None or False"
        )
    return False


def _log_fallback(device_type: str) -> None:
    _log.warning(
        "chunked_loss: compiled per-chunk kernels unavailable on %s (%s); using the exact eager "
        "kernels (same results, more passes over each [chunk, V] block)",
        device_type,
        _unavailable[device_type],
    )


@functools.lru_cache(maxsize=64)
def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A 0-d fp32 tensor: a graph input rather than a constant, so every ε shares one graph."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def _try_compiled(index: int, choice: bool | None, *args) -> tuple[bool, object]:
    """``(True, result)`` of compiled kernel ``index``, or ``(False, None)`` where the eager
    kernel must run: ``compiled`` is off, unavailable, or compilation failed (which raises
    before the compiled kernel writes anything)."""
    device = args[0].device
    if not use_compiled(choice, device):
        return False, None
    try:
        return True, _compiled()[index](*args)
    except _compat.compile_errors() as err:
        if choice:
            raise RuntimeError(
                f"compiled=True, but torch.compile failed on {device.type}: {err}"
            ) from err
        _unavailable[device.type] = f"torch.compile failed: {type(err).__name__}: {err}"
        _log_fallback(device.type)
        return False, None


def row_stats(logits_CV: torch.Tensor, col_C: torch.Tensor, compiled: bool | None):
    """``(max_C, sumexp_C, target_C, zsum_C)`` of a [C, V] fp32 block, V ≥ 1."""
    ok, out = _try_compiled(0, compiled, logits_CV, col_C)
    if ok:
        return out
    max_C = logits_CV.amax(dim=1)
    sumexp_C = (logits_CV - max_C[:, None]).exp_().sum(dim=1)
    target_C = logits_CV.gather(1, col_C[:, None]).squeeze(1)
    return max_C, sumexp_C, target_C, logits_CV.sum(dim=1)


def dlogits_(logits_CV, lse_C, col_C, tw_C, scale_C, smooth: float, compiled: bool | None):
    """In place: ``logits_CV ← scale_C · (exp(logits − lse_C) − smooth − tw_C · onehot(col_C))``
    (``smooth`` = ε/V); returns the block."""
    args = (logits_CV, lse_C, col_C, tw_C, scale_C, _scalar(smooth, logits_CV.device))
    if _try_compiled(1, compiled, *args)[0]:
        return logits_CV
    probs_CV = logits_CV.sub_(lse_C[:, None]).exp_()
    return _probs_to_dlogits_(probs_CV, col_C, tw_C, scale_C, smooth)


def softmax_dlogits_(logits_CV, col_C, tw_C, scale_C, smooth: float, compiled: bool | None):
    """``dlogits_`` with the block's own ``lse`` (the whole vocabulary is here); returns
    ``(lse_C, target_C, zsum_C)``, read before the block is overwritten. ``zsum_C`` is None on
    the eager path when ``smooth`` is 0 (not needed then)."""
    ok, out = _try_compiled(0, compiled, logits_CV, col_C)
    if ok:
        max_C, sumexp_C, target_C, zsum_C = out
        lse_C = max_C + sumexp_C.log()
        dlogits_(logits_CV, lse_C, col_C, tw_C, scale_C, smooth, compiled)
        return lse_C, target_C, zsum_C
    target_C = logits_CV.gather(1, col_C[:, None]).squeeze(1)
    zsum_C = logits_CV.sum(dim=1) if smooth > 0.0 else None
    # Softmax in the block's own buffer (no logsumexp temporary, one exp pass):
    # lse = max + log Σ exp(z − max), softmax = exp(z − max) / Σ exp(z − max).
    max_C = logits_CV.amax(dim=1)
    probs_CV = logits_CV.sub_(max_C[:, None]).exp_()
    sum_C = probs_CV.sum(dim=1)
    _probs_to_dlogits_(probs_CV.div_(sum_C[:, None]), col_C, tw_C, scale_C, smooth)
    return max_C + sum_C.log(), target_C, zsum_C


def _probs_to_dlogits_(probs_CV, col_C, tw_C, scale_C, smooth: float) -> torch.Tensor:
    if smooth > 0.0:
        probs_CV.sub_(smooth)
    probs_CV.scatter_add_(1, col_C[:, None], -tw_C[:, None])
    return probs_CV.mul_(scale_C[:, None])
