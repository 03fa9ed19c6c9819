"""The FP8 base on CUDA against the dequantize path: the table decode bit for bit as torch
converts on the GPU, the block-scaled FP8 GEMM (:mod:`moe_parallel.fp8_gemm`) against the linear
of the dequantized weight (and, tightly, of the dequantized weight and the e4m3-rounded
activations) forward and backward, and the dequantize path wherever the GEMM does not apply.
The GPU tests skip without CUDA (the GEMM ones without a GPU that runs it); the first test
pins, on any machine, that the GEMM is never taken off CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_testkit import assert_close
from moe_parallel import BlockFormat, FP8Weight, dequantize, fp8_linear, quantize
from moe_parallel.fp8_gemm import (
    _quantize_rows,
    block_scaled_linear,
    block_scaled_mm_supported,
    takes_block_scaled_mm,
)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
needs_gemm = pytest.mark.skipif(
    not (CUDA and block_scaled_mm_supported(torch.device("cuda"))),
    reason="needs torch's block-scaled FP8 GEMM (compute capability 9.x, cuBLASLt >= 12.9)",
)
FORM = BlockFormat((128, 128))


def _weight(out_features, in_features, device, form=FORM, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = 0.05 * torch.randn(out_features, in_features, generator=g)
    return FP8Weight(*(t.to(device) for t in quantize(w, form)), form)


def test_the_gemm_is_never_taken_off_cuda():
    weight = _weight(256, 256, "cpu")
    x = torch.randn(4, 256).bfloat16()
    assert not block_scaled_mm_supported(torch.device("cpu"))
    assert not takes_block_scaled_mm(x, weight)
    with pytest.raises(ValueError, match=r"compute capability 9\.x"):
        block_scaled_linear(x, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@needs_cuda
def test_decode_on_cuda_is_torchs_conversion_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (3, 256, 384), dtype=torch.uint8, generator=g)
    data[0, 0, :256] = torch.arange(256, dtype=torch.uint8)  # every byte
    form = BlockFormat((128, 128), 2)
    scale = torch.rand(form.scale_shape(tuple(data.shape)), generator=g) + 1e-3
    data, scale = data.view(torch.float8_e4m3fn).cuda(), scale.cuda()
    got = dequantize(data, scale, form, dtype=dtype)
    expanded = scale.view(6, 1, 1, 3, 1).expand(6, 128, 1, 3, 128).reshape(3, 256, 384)
    want = (data.to(torch.float32) * expanded).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))


@pytest.mark.gpu
@needs_cuda
@needs_gemm
def test_block_scaled_gemm_equals_the_dequantized_linear():
    """bf16 activations [3, 50, 256] and a weight [384, 256] in 128 x 128 blocks: ``fp8_linear``
    takes the GEMM, saves only the FP8 bytes and scales, and equals the linear of the
    dequantized weight to e4m3's rounding of the activations (and the linear of the rounded
    activations to bf16's output rounding); the input gradient is the dequantized weight's."""
    weight = _weight(384, 256, "cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(3, 50, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    assert takes_block_scaled_mm(x, weight)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fp8_linear(x, weight)
    assert not [t for t in saved if t.shape == weight.shape and t.dtype != torch.float8_e4m3fn]
    dense = dequantize(weight.data, weight.scale, weight.form)
    want = F.linear(x.detach().float(), dense)
    assert (y.float() - want).norm() <= 0.05 * want.norm()
    x_fp8, scale_a = _quantize_rows(x.detach().reshape(150, 256))
    rounded = (x_fp8.float().view(150, 2, 128) * scale_a[..., None]).view(3, 50, 256)
    assert_close(y.float(), F.linear(rounded, dense), rtol=1e-2, atol=1e-2, name="fp8 gemm")
    g_out = torch.randn(y.shape, device="cuda", generator=g).bfloat16()
    (gx,) = torch.autograd.grad(y, x, g_out)
    assert_close(gx.float(), g_out.float() @ dense, rtol=2e-2, atol=2e-2, name="fp8 gemm x.grad")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", ["fp32", "small blocks", "odd dims"])
def test_elsewhere_the_dequantize_path_is_exact(case):
    """Where the GEMM does not apply (fp32 activations, blocks other than 128 x 128, dimensions
    not multiples of 128) ``fp8_linear`` is the linear of the dequantized weight, exactly."""
    form = BlockFormat((16, 16)) if case == "small blocks" else FORM
    weight = _weight(200 if case == "odd dims" else 256, 256, "cuda", form)
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    x = torch.randn(2, 9, 256, device="cuda").to(dtype).requires_grad_()
    assert not takes_block_scaled_mm(x, weight)
    dense = dequantize(weight.data, weight.scale, form, dtype=dtype).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, want = fp8_linear(x, weight), F.linear(x_ref, dense)
    assert torch.equal(y, want)
    g_out = torch.randn_like(y)
    assert torch.equal(
        torch.autograd.grad(y, x, g_out)[0], torch.autograd.grad(want, x_ref, g_out)[0]
    )
