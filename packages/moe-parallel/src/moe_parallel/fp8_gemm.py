"""A frozen FP8 projection through torch's block-scaled FP8 GEMM on CUDA, where the GPU takes it.

``torch.nn.functional.scaled_mm`` multiplies e4m3 operands with fp32 block scales in one cuBLASLt
kernel (the DeepSeek-style recipe: ``ScalingType.BlockWise1x128`` for the activations,
``ScalingType.BlockWise128x128`` for the weight). The weight's FP8 bytes and scales go in as
the checkpoint stores them (blocks of 128 × 128, :mod:`moe_parallel.fp8`), nothing dequantized.
The activations ``x`` [M, K] are quantized on the fly, each row's 128-column block ``j`` to
``e4m3(x / s)`` with ``s = amax / 448`` (1 for a zero block), so the forward is
``y = Σ_j (s_a ⊙ x̂_j) (s_w ⊙ Ŵ_j)^T``: the linear of the dequantized weight up to e4m3's
rounding of the activations (3 mantissa bits: at most 1/16 relative per element). The
backward is the input gradient of the dequantized weight's linear, ``dL/dx = dL/dy · W`` with
``W`` dequantized in the gradient's dtype (the activations' rounding passed straight through,
the FP8 training recipes' convention); the weight is frozen. Saved: the FP8 bytes and scales.

Where (:func:`block_scaled_mm_supported`): a CUDA device whose cuBLASLt runs the recipe — torch
implements it for compute capability 9.x (Hopper) with cuBLASLt 12.9 or later; a one-off probe
on the device decides — for 2-D weights in blocks of 128 × 128 whose dimensions are multiples
of 128, bf16 activations. Everything else (CPU, other GPUs, the stacked experts, fp32) takes
the dequantize path (:func:`moe_parallel.fp8_linear`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moe_parallel.fp8 import E4M3_MAX, FP8_DTYPE, BlockFormat, FP8Weight, dequantize

__all__ = ["block_scaled_linear", "block_scaled_mm_supported", "takes_block_scaled_mm"]

BLOCK = 128


@functools.cache
def _probe(device_index: int) -> bool:
    """A tiny block-scaled GEMM on the device: whether torch and cuBLASLt run the recipe."""
    device = torch.device("cuda", device_index)
    try:
        x = torch.ones(BLOCK, BLOCK, device=device, dtype=torch.bfloat16)
        data = torch.ones(BLOCK, BLOCK, device=device).to(FP8_DTYPE)
        w = FP8Weight(data, torch.ones(1, 1, device=device), BlockFormat((BLOCK, BLOCK)))
        y = _scaled_mm(x, w)
        return bool(torch.all(y == BLOCK))
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return False


def block_scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``device`` runs torch's 1×128 / 128×128 block-scaled FP8 GEMM (module docstring)."""
    if device.type != "cuda" or not hasattr(F, "scaled_mm"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] == 9 and _probe(index)


def takes_block_scaled_mm(x: torch.Tensor, weight: FP8Weight) -> bool:
    """Whether ``linear(x, weight)`` runs on the block-scaled GEMM (module docstring)."""
    out_features, in_features = weight.shape[-2:]
    return (
        weight.data.dim() == 2
        and weight.form.block == (BLOCK, BLOCK)
        and weight.form.parts == 1
        and x.dtype == torch.bfloat16
        and in_features % BLOCK == 0
        and out_features % BLOCK == 0
        and x.numel() > 0
        and block_scaled_mm_supported(x.device)
    )


def _quantize_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [M, K], scales [M, K / 128] fp32, column-major)``: each row's 128-column blocks
    scaled by ``amax / 448`` (1 for a zero block)."""
    m, k = x_MK.shape
    blocks = x_MK.float().view(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    data = (blocks / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).view(m, k)
    return data, scale.t().contiguous().t()


def _scaled_mm(x_MK: torch.Tensor, weight: FP8Weight) -> torch.Tensor:
    """[M, N] bf16: ``x_MK`` (bf16) times the FP8 ``weight`` [N, K]^T on the block-scaled GEMM."""
    x_fp8, scale_a = _quantize_rows(x_MK)
    # the weight's scales [N / 128, K / 128] as the kernel reads them: K's blocks padded to a
    # multiple of 4, then transposed (column-major [round_up(K / 128, 4), N / 128])
    nb, kb = weight.scale.shape
    scale_b = torch.ones(nb, -(-kb // 4) * 4, device=x_MK.device)
    scale_b[:, :kb] = weight.scale.float()
    return F.scaled_mm(
        x_fp8,
        weight.data.t(),
        scale_a,
        F.ScalingType.BlockWise1x128,
        scale_b.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )


class _BlockScaledLinear(torch.autograd.Function):
    """Forward on the block-scaled GEMM, backward through the dequantized weight (module
    docstring); saves the FP8 bytes and scales."""

    @staticmethod
    def forward(ctx, x, data, scale, form):
        ctx.save_for_backward(data, scale)
        ctx.form = form
        y = _scaled_mm(x.reshape(-1, x.shape[-1]).contiguous(), FP8Weight(data, scale, form))
        return y.view(*x.shape[:-1], data.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        data, scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        weight = dequantize(data, scale, ctx.form, dtype=grad_y.dtype)
        return grad_y @ weight, None, None, None


def block_scaled_linear(x: torch.Tensor, weight: FP8Weight) -> torch.Tensor:
    """``x [..., K] → [..., N]`` bf16 through the block-scaled FP8 GEMM, for an FP8 ``weight``
    [N, K] where :func:`takes_block_scaled_mm` holds (module docstring); differentiable in ``x``
    only."""
    if not takes_block_scaled_mm(x, weight):
        raise ValueError(
            f"the block-scaled FP8 GEMM takes bf16 activations on a CUDA device that runs it "
            f"(compute capability 9.x) and a 2-D weight in one part of 128 x 128 blocks with "
            f"dimensions multiple of 128; got {x.dtype} x on {x.device}, weight "
            f"{list(weight.shape)} in blocks {list(weight.form.block)} "
            f"({weight.form.parts} parts)"
        )
    return _BlockScaledLinear.apply(x, weight.data, weight.scale, weight.form)
