"""The three matmuls of a chunk, on the fastest exact fp32 kernel the device has.

Per chunk of C valid rows (``hidden_CH``), the loss needs

    z_CV = h_CH W_VHᵀ + b_V           (``chunk_logits``, into the chunk's fp32 block)
    ∂h_CH = dz_CV W_VH                (``accumulate``, scattered into the [N, H] gradient)
    ∂W_VH += dz_CVᵀ h_CH, ∂b_V += Σ_rows dz_CV   (``accumulate``, fp32 accumulators)

and nothing else touches W. Two backends compute exactly these products:

- ``aten``: ``torch.mm`` / ``addmm_`` (cuBLAS on GPU, MKL in x86 CPU builds of torch). Used on
  every device but the CPU, and on the CPU for inputs that are not fp32 (torch already sends
  bf16/fp16 CPU matmuls to oneDNN where the CPU supports them).
- ``onednn`` (CPU, fp32, the default there): oneDNN's inner-product primitive through
  ``torch.ops.mkldnn._linear_pointwise`` — the op Inductor lowers CPU linears to. On the AMD
  EPYC this package is developed on, MKL's fp32 GEMM runs these shapes at about half the rate
  of oneDNN's (MKL picks its code path by CPU vendor; oneDNN by the instruction sets present):
  the whole loss at N = 4096, H = 1024, V = 248,320 takes 16.6 s against 36.5 s on MKL
  (README, "Benchmark"). Both are IEEE fp32 with fp32 accumulation; only the order of the
  additions differs (and oneDNN follows ``torch.backends.mkldnn.matmul.fp32_precision`` as
  aten's CPU matmuls do).

The op returns a new tensor and has no accumulating (``beta = 1``) form, so the oneDNN backend
cuts the two [*, V]-sized outputs into slices of at most ``SLICE_BYTES``: the logits are written
into the chunk's block one column slice at a time, and ``∂W`` is accumulated one row slice at a
time (each slice's product is added into its rows of the fp32 accumulator). The slices
partition the output, so every product is computed exactly once: the FLOPs are those of the
three matmuls, and the extra memory is one slice (8 MiB), small enough to stay in cache
between its product and its copy. The bias is made contiguous first: the op silently
misreads a strided bias.

``CHUNKED_LOSS_CPU_MATMUL=aten`` selects the aten backend on the CPU too (benchmarks, or a CPU
whose oneDNN is slower); an unknown value raises. While a ``TorchDispatchMode`` is active the
aten backend runs too, so that a FLOP counter (``torch.utils.flop_counter.FlopCounterMode``
has formulas for aten's matmuls, not for oneDNN's op) counts the loss's matmuls. If oneDNN is missing from this torch build or
fails its one-time probe, the aten backend runs and the reason is logged once.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from chunked_loss import _compat

__all__ = ["accumulate", "backend", "chunk_logits", "env_error"]

_log = logging.getLogger("chunked_loss")

ENV = "CHUNKED_LOSS_CPU_MATMUL"
BACKENDS = ("onednn", "aten")
# The largest temporary one sliced oneDNN product may allocate.
SLICE_BYTES = 8 << 20


def env_error() -> str | None:
    """The message for a bad ``CHUNKED_LOSS_CPU_MATMUL``, or None (checked with the inputs, so
    that TP ranks agree on it before any raises)."""
    choice = os.environ.get(ENV, "onednn")
    return None if choice in BACKENDS else f"{ENV} must be one of {BACKENDS}, got {choice!r}"


def backend(weight_VH: torch.Tensor) -> str:
    """``"onednn"`` or ``"aten"`` for a chunk of products with this weight (see the docstring)."""
    if (error := env_error()) is not None:
        raise ValueError(error)
    choice = os.environ.get(ENV, "onednn")
    if (
        choice == "aten"
        or weight_VH.device.type != "cpu"
        or weight_VH.dtype != torch.float32
        or weight_VH.shape[1] == 0  # oneDNN has no primitive for an empty reduction
        or not weight_VH.is_contiguous()
        or _compat.dispatch_mode_active()  # FLOP counters know aten's matmuls, not oneDNN's op
    ):
        return "aten"
    return "onednn" if _onednn() is not None else "aten"


@functools.cache
def _onednn():
    """oneDNN's linear op, or None (logged once) when this torch cannot run it correctly."""
    linear, why = _compat.onednn_linear(), None
    if linear is None:
        why = "this torch build has no oneDNN (torch.ops.mkldnn._linear_pointwise)"
    else:
        x_CH = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        w_VH = torch.tensor([[1.0, 0.0], [1.0, -1.0], [0.5, 0.5]])
        want_CV = torch.tensor([[1.0, -1.0, 1.5], [3.0, -1.0, 3.5]])
        try:
            ok = torch.equal(linear(x_CH, w_VH, None, "none", [], ""), want_CV)
            why = None if ok else "oneDNN gave a wrong product on a probe"
        except RuntimeError as err:
            why = f"oneDNN failed on a probe: {err}"
    if why is None:
        return linear
    _log.info("chunked_loss: CPU fp32 matmuls use aten (MKL) instead of oneDNN: %s", why)
    return None


def chunk_logits(block_CV, hidden_CH, weight_VH, bias_V) -> torch.Tensor:
    """``hidden_CH @ weight_VH.T + bias_V`` in fp32, written into ``block_CV`` (low-precision
    inputs: the matmul runs in their dtype, as ``F.linear`` does, then upcasts)."""
    if backend(weight_VH) == "onednn":
        linear = _onednn()
        bias_V = None if bias_V is None else bias_V.contiguous()
        step = max(1, SLICE_BYTES // (4 * block_CV.shape[0]))
        for s in range(0, weight_VH.shape[0], step):
            bias_S = None if bias_V is None else bias_V[s : s + step]
            block_CV[:, s : s + step] = linear(
                hidden_CH, weight_VH[s : s + step], bias_S, "none", [], ""
            )
        return block_CV
    if weight_VH.dtype != torch.float32:
        return block_CV.copy_(torch.nn.functional.linear(hidden_CH, weight_VH, bias_V))
    if bias_V is None:
        return torch.mm(hidden_CH, weight_VH.t(), out=block_CV)
    return torch.addmm(bias_V, hidden_CH, weight_VH.t(), out=block_CV)


def accumulate(dz_CV, hidden_CH, rows_C, weight_VH, grad_h, grad_w32, grad_b32) -> None:
    """The two gradient matmuls of one chunk (and the bias sum): ``∂h[rows_C] = dz W``,
    ``∂W += dzᵀ h``, ``∂b += Σ_rows dz``."""
    onednn = backend(weight_VH) == "onednn"
    if grad_h is not None:
        if onednn:  # W passed as the [H, V] "out × in" weight of the product
            dh_CH = _onednn()(dz_CV, weight_VH.t(), None, "none", [], "")
        else:
            dh_CH = dz_CV.to(weight_VH.dtype) @ weight_VH
        grad_h.index_copy_(0, rows_C, dh_CH)
    if grad_w32 is not None:
        if onednn:
            hidden_HC = hidden_CH.t().contiguous()
            step = max(1, SLICE_BYTES // (4 * grad_w32.shape[1]))
            for s in range(0, grad_w32.shape[0], step):
                dz_SC = dz_CV[:, s : s + step].t()
                grad_w32[s : s + step] += _onednn()(dz_SC, hidden_HC, None, "none", [], "")
        else:
            # addmm with out= (not addmm_): the same in-place kernel, but an op FlopCounterMode
            # has a formula for
            torch.addmm(grad_w32, dz_CV.t(), hidden_CH.float(), out=grad_w32)
    if grad_b32 is not None:
        grad_b32 += dz_CV.sum(dim=0)
