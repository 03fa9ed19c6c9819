"""Dropless SwiGLU expert compute over rows already grouped by expert.

Rows arrive sorted by expert (``counts_E[e]`` consecutive rows for expert ``e``), so one grouped
GEMM per projection covers every expert: ``torch._grouped_mm`` multiplies row block ``e`` by
weight ``e``. Nothing is padded or dropped; the result equals a loop ``x_e @ W_e^T`` per expert.

``torch._grouped_mm`` is used only where a one-off probe showed it runs forward AND backward for
the device and dtype (fp32 on CPU in torch 2.15; it rejects float64 and widths whose byte stride is
not a multiple of 16, and its backward fails on zero rows). Elsewhere an exact per-expert loop is
used and the switch is logged once. Both paths keep every expert weight in the autograd graph, so
an expert that received no rows gets a zero gradient, never ``None``. ``backend="te"`` computes the
same with TransformerEngine's ``GroupedLinear`` instead (:mod:`moe_parallel.te_backend`), under
the same zero-gradient contract.

With low-rank adapters (:class:`LoRAFactors`, :mod:`moe_parallel.lora`) each projection adds
``s · (drop(x) A_e^T) B_e^T`` to its rows: two more grouped GEMMs (or loops) through the rank,
on the torch backend only (TransformerEngine's fused path has no place for the adapters).
Adapters kept in another dtype than the rows (fp32 masters under bf16 compute) are cast to the
rows' dtype here, as a mixed-precision all-gather would have.

Frozen expert weights held in block-scaled FP8 (:class:`~moe_parallel.fp8.FP8Weight`) are
dequantized per projection and call, in the rows' dtype, by :func:`moe_parallel.fp8_linear`
(the backward dequantizes again; the FP8 bytes are what is saved), on the torch backend.

On CPU with frozen expert weights the torch backend runs in pieces of consecutive experts
(:mod:`moe_parallel.pieces`: small temporaries instead of fresh pages; bit for bit the same).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from moe_parallel import te_backend
from moe_parallel.fp8 import FP8Weight
from moe_parallel.fp8_matmul import fp8_linear
from moe_parallel.pieces import in_pieces, takes_pieces

__all__ = ["EXPERT_BACKENDS", "LoRAFactors", "expert_swiglu", "grouped_mm_works", "loop_linear"]

EXPERT_BACKENDS = ("auto", "torch", "te")

_log = logging.getLogger(__name__)
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _probe(device_type: str, dtype: torch.dtype) -> bool:
    """Run a tiny grouped GEMM forward and backward, isolated from the caller's autograd state.

    It first runs inside a model's forward, possibly inside an activation-checkpointed block.
    Its saved tensors must not reach the checkpoint's pack hooks (its backward would unpack them
    and trigger the block's recompute in the middle of the forward, then again in the real
    backward), and its ops must not reach a selective-checkpoint dispatch mode (they would be
    counted among the block's ops, which the recompute would not replay). Hence pass-through
    saved-tensor hooks and no active dispatch modes.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    passthrough = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with _disable_current_modes(), passthrough, torch.enable_grad():
        return _probe_run(device_type, dtype)


def grouped_linear(x_MI: torch.Tensor, offs: torch.Tensor, w_EOI: torch.Tensor) -> torch.Tensor:
    """[M, O]: row block ``e`` (ending at ``offs[e]``) times ``w_EOI[e]^T``, one grouped GEMM.

    The CPU kernel's backward rejects a stride-0 (expanded) output gradient, which is what e.g.
    ``y.sum().backward()`` sends; a hook makes the gradient contiguous (free when it is).
    """
    y_MO = torch._grouped_mm(x_MI, w_EOI.transpose(1, 2), offs=offs)
    if y_MO.requires_grad:
        y_MO.register_hook(torch.Tensor.contiguous)
    return y_MO


def _probe_run(device_type: str, dtype: torch.dtype) -> bool:
    try:
        x = torch.ones(3, 8, device=device_type, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 8, 8, device=device_type, dtype=dtype, requires_grad=True)
        offs = torch.tensor([1, 3], device=device_type, dtype=torch.int32)
        y = grouped_linear(x, offs, w)
        gx, gw = torch.autograd.grad(y.sum(), (x, w))
        # all-ones: d(sum)/dx = 8 (output width); expert e's weight grad = its row count (1, 2)
        rows_ok = bool(torch.all(gw[0] == 1)) and bool(torch.all(gw[1] == 2))
        return rows_ok and bool(torch.all(gx == 8)) and bool(torch.all(y == 8))
    except (RuntimeError, NotImplementedError):
        return False


def grouped_mm_works(x: torch.Tensor, *widths: int) -> bool:
    """Whether the grouped-GEMM path runs forward and backward for ``x``'s device and dtype,
    with matrices of these ``widths`` (hidden, intermediate, adapter rank)."""
    if x.dtype not in _GROUPED_DTYPES or x.shape[0] == 0:
        return False
    size = x.element_size()
    if any((width * size) % 16 for width in widths):
        return False
    return _probe(x.device.type, x.dtype)


_warned: set[tuple[str, torch.dtype]] = set()


def loop_linear(x_MH: torch.Tensor, counts: list[int], w_EOH: torch.Tensor) -> torch.Tensor:
    """``x_e @ w_EOH[e].T`` for each row block ``x_e`` (exact; idle experts get zero grads)."""
    pieces = [F.linear(x_e, w_EOH[e]) for e, x_e in enumerate(torch.split(x_MH, counts))]
    return torch.cat(pieces)


class LoRAFactors(NamedTuple):
    """The experts' adapters as :func:`expert_swiglu` takes them (this rank's experts):
    ``gate_up_A`` [E, r, H], ``gate_up_B`` [E, 2I, r], ``down_A`` [E, r, I], ``down_B``
    [E, H, r], the ``scale`` s and the ``dropout`` probability on the adapters' input (0 in
    evaluation)."""

    gate_up_A: torch.Tensor
    gate_up_B: torch.Tensor
    down_A: torch.Tensor
    down_B: torch.Tensor
    scale: float
    dropout: float = 0.0


def _adapted(linear, x_MI, w_EOI, a_ERI, b_EOR, lora: LoRAFactors | None):
    """``linear(x, w)`` (``w`` dequantized for the call when it is FP8) plus, with ``lora``,
    ``linear(s · linear(drop(x), A), B)`` with the adapters in the rows' dtype (the scale on the
    rank-``r`` rows, not on the ``O``-wide term)."""
    y_MO = fp8_linear(x_MI, w_EOI, linear) if isinstance(w_EOI, FP8Weight) else linear(x_MI, w_EOI)
    if lora is None:
        return y_MO
    x_in = F.dropout(x_MI, lora.dropout) if lora.dropout else x_MI
    a_ERI, b_EOR = a_ERI.to(x_MI.dtype), b_EOR.to(x_MI.dtype)
    return y_MO + linear(lora.scale * linear(x_in, a_ERI), b_EOR)


def expert_swiglu(
    x_MH: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_E2IH: torch.Tensor | FP8Weight,
    down_EHI: torch.Tensor | FP8Weight,
    *,
    backend: str = "auto",
    lora: LoRAFactors | None = None,
) -> torch.Tensor:
    """``down_e(silu(gate_e(x)) * up_e(x))`` for every row, with row blocks grouped by expert.

    Args:
        x_MH: [M, H] rows sorted by expert.
        counts_E: [E] int, rows per expert (sums to M).
        gate_up_E2IH: [E, 2I, H], gate rows first then up rows (transformers' layout); or
            frozen in FP8 (:class:`~moe_parallel.fp8.FP8Weight`, in 2 parts: gate, up).
        down_EHI: [E, H, I] (or FP8, one part).
        backend: ``"torch"`` (grouped GEMM or exact loop, any device), ``"te"``
            (TransformerEngine's ``GroupedLinear``, CUDA; see :mod:`moe_parallel.te_backend`) or
            ``"auto"``: ``"te"`` for CUDA rows when TransformerEngine imports, else ``"torch"``
            (always ``"torch"`` with ``lora`` or FP8 weights). A call with no rows always takes
            the exact loop.
        lora: the experts' low-rank adapters (:class:`LoRAFactors`), or ``None``.

    Returns:
        [M, H], row ``m`` computed by the expert that owns it.
    """
    num_experts, two_i, hidden = gate_up_E2IH.shape
    if counts_E.shape != (num_experts,):
        raise ValueError(f"counts_E must be [{num_experts}], got {tuple(counts_E.shape)}")
    if x_MH.dim() != 2 or x_MH.shape[1] != hidden:
        raise ValueError(f"x_MH must be [M, {hidden}], got {tuple(x_MH.shape)}")
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"backend must be one of {EXPERT_BACKENDS}, got {backend!r}")
    if backend == "te" and lora is not None:
        raise ValueError(
            "expert LoRA runs on the torch backend: TransformerEngine's grouped "
            "path has no place for the adapters (expert_backend='torch' or 'auto')"
        )
    fp8 = isinstance(gate_up_E2IH, FP8Weight)
    if backend == "te" and fp8:
        raise ValueError(
            "FP8 expert weights run on the torch backend (dequantized per call): "
            "TransformerEngine's grouped path takes bf16/fp32 weights (expert_backend='torch' "
            "or 'auto')"
        )
    if backend == "auto":
        on_te_device = x_MH.device.type in te_backend.TE_DEVICE_TYPES
        usable = on_te_device and te_backend.te_available() and lora is None and not fp8
        backend = "te" if usable else "torch"
    if backend == "te" and x_MH.shape[0] > 0:
        return te_backend.te_expert_swiglu(x_MH, counts_E, gate_up_E2IH, down_EHI)
    widths = (hidden, two_i // 2) + ((lora.gate_up_A.shape[1],) if lora is not None else ())
    grouped = grouped_mm_works(x_MH, *widths)
    if not grouped:
        key = (x_MH.device.type, x_MH.dtype)
        if x_MH.shape[0] > 0 and key not in _warned:
            _warned.add(key)
            _log.info("torch._grouped_mm unavailable for %s %s: exact per-expert loop", *key)

    def run(x, counts, gate_up, down, *factors):
        """The SwiGLU of rows ``x`` grouped by ``counts`` over these experts' weights."""
        linear = _linear_of(counts, grouped)
        adapters = LoRAFactors(*factors, lora.scale, lora.dropout) if factors else None
        a, b = (adapters.gate_up_A, adapters.gate_up_B) if factors else (None, None)
        gate, up = _adapted(linear, x, gate_up, a, b, adapters).chunk(2, dim=-1)
        a, b = (adapters.down_A, adapters.down_B) if factors else (None, None)
        return _adapted(linear, F.silu(gate) * up, down, a, b, adapters)

    factors = list(lora[:4]) if lora is not None else []
    if takes_pieces(x_MH.shape[0], x_MH.device, gate_up_E2IH, down_EHI):
        return in_pieces(x_MH, counts_E, [gate_up_E2IH, down_EHI, *factors], run)
    return run(x_MH, counts_E, gate_up_E2IH, down_EHI, *factors)


def _linear_of(counts_E: torch.Tensor, grouped: bool):
    """``linear(x, w)``: row block ``e`` (``counts_E[e]`` rows) times ``w[e]^T``, by one grouped
    GEMM or the exact per-expert loop."""
    if grouped:
        offs = torch.cumsum(counts_E, 0).to(torch.int32)
        return lambda x, w: grouped_linear(x, offs, w)
    counts = counts_E.tolist()
    return lambda x, w: loop_linear(x, counts, w)
