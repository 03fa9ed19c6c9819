"""cuBLAS prewarm: a tiny matmul forward and backward per dtype on the target CUDA device.

cuBLAS creates a handle and a workspace per (thread, stream) on first use, outside PyTorch's
caching allocator; the backward pass runs on autograd's device thread, which gets its own. One
small ``F.linear`` with a bias (the cublasLt epilogue path) and one without, forward and
backward, in each training dtype, creates them at setup instead of at the first step's peak.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from setup_prewarm.report import SkipStep

__all__ = ["warm_cublas"]

_SIZE = 64


def warm_cublas(device: torch.device, dtypes: Sequence[torch.dtype]) -> str:
    """Run ``F.linear`` (with and without bias) forward+backward for each dtype on ``device``.

    Inputs are ``[64, 64]`` matrices. Raises :class:`SkipStep` off CUDA.
    """
    if device.type != "cuda":
        raise SkipStep(f"cuBLAS needs a CUDA device, got {device}")
    for dtype in dtypes:
        x_NK = torch.randn(_SIZE, _SIZE, device=device, dtype=dtype, requires_grad=True)
        w_MK = torch.randn(_SIZE, _SIZE, device=device, dtype=dtype, requires_grad=True)
        b_M = torch.randn(_SIZE, device=device, dtype=dtype, requires_grad=True)
        out_NM = F.linear(x_NK, w_MK, b_M) + F.linear(x_NK, w_MK)
        out_NM.backward(torch.ones_like(out_NM))
        if x_NK.grad is None or w_MK.grad is None or b_M.grad is None:
            raise RuntimeError(f"matmul backward in {dtype} produced no gradient")
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    return f"matmul fwd+bwd in {names}"
