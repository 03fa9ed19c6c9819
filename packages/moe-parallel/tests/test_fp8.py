"""Block-scaled FP8 frozen weights (:mod:`moe_parallel.fp8`) against independent references:
a block-by-block loop that quantizes and dequantizes one block at a time (bit for bit), the
dense and grouped linears over the hand-dequantized weights (forward and the input's and
adapters' gradients), and what autograd saves (the FP8 bytes, never a dequantized weight).

Shapes are not multiples of the blocks (edge blocks are partial), blocks are not square (a
scale read from the transposed block grid would not even fit), one block is all zeros, and
every expert has its own scales (an expert given its neighbour's scales changes the result)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_parallel import (
    BlockFormat,
    FP8Weight,
    LoRAFactors,
    LoRASpec,
    MoE,
    add_expert_lora,
    dequantize,
    expert_swiglu,
    fp8_linear,
    quantize,
    quantize_experts,
)
from moe_parallel.grouped import grouped_mm_works

BLOCK = (5, 3)  # rows, columns: neither divides the shapes below
H, INTER, E = 16, 12, 4


def _weights(*shape, seed=0):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    w *= torch.rand(*shape[:-2], 1, 1, generator=torch.Generator().manual_seed(seed + 1)) + 0.1
    w[..., : BLOCK[0], : BLOCK[1]] = 0.0  # one all-zero block per matrix
    return w


def _blocks(rows, cols, block):
    """``(i, j, row slice, column slice)`` of every block."""
    bo, bi = block
    for i in range(-(-rows // bo)):
        for j in range(-(-cols // bi)):
            yield i, j, slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi)


def _reference_quantize(w2d, block, scale_dtype):
    """One block at a time: s = amax / 448 (1 for zeros), rounded to the scale dtype, then
    e4m3(clamp(w / s))."""
    rows, cols = w2d.shape
    data = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-rows // block[0]), -(-cols // block[1]), dtype=scale_dtype)
    for i, j, r, c in _blocks(rows, cols, block):
        amax = w2d[r, c].abs().max()
        s = (amax / 448.0 if amax > 0 else torch.tensor(1.0)).to(scale_dtype)
        scale[i, j] = s
        data[r, c] = (w2d[r, c] / s.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return data, scale


def _reference_dequantize(data2d, scale2d, block):
    out = torch.empty(data2d.shape)
    for i, j, r, c in _blocks(*data2d.shape, block):
        out[r, c] = data2d[r, c].float() * scale2d[i, j].float()
    return out


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_quantize_equals_the_block_loop_bit_for_bit(scale_dtype):
    w = _weights(3, 2 * INTER, H)  # 3 experts' fused gate/up: 2 parts of 12 rows each
    form = BlockFormat(BLOCK, parts=2)
    data, scale = quantize(w, form, scale_dtype=scale_dtype)
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == scale_dtype
    assert scale.shape == (3, 2 * 3, 6)  # 2 parts x ceil(12 / 5) block rows, ceil(16 / 3)
    for e in range(3):
        for part in range(2):
            rows = slice(part * INTER, (part + 1) * INTER)
            want_data, want_scale = _reference_quantize(w[e, rows], BLOCK, scale_dtype)
            got_scale = scale[e, part * 3 : (part + 1) * 3]
            assert torch.equal(_bytes(data[e, rows]), _bytes(want_data)), (e, part)
            assert torch.equal(got_scale, want_scale), (e, part)
    assert torch.all(scale[:, 0, 0] == 1)  # the zero block
    assert torch.all(data[:, : BLOCK[0], : BLOCK[1]].float() == 0)
    # round trip: e4m3's resolution (3 mantissa bits: half an ulp is 1/16 relative)
    back = dequantize(data, scale, form)
    assert torch.all((back - w).abs() <= w.abs() / 16 + 1e-12)


def test_dequantize_equals_the_block_loop_bit_for_bit():
    w = _weights(2 * INTER, H, seed=5)
    form = BlockFormat(BLOCK)
    data, scale = quantize(w, form)
    scale = scale * torch.linspace(0.5, 2.0, scale.numel()).view(scale.shape)  # no symmetry
    want = _reference_dequantize(data, scale, BLOCK)
    assert torch.equal(dequantize(data, scale, form), want)
    assert torch.equal(dequantize(data, scale, form, dtype=torch.bfloat16), want.bfloat16())
    with pytest.raises(ValueError, match=r"scale of shape \[6, 5\] .* expected \[5, 6\]"):
        dequantize(data, scale.reshape(6, 5), form)
    out = torch.full(data.shape, float("nan"))
    assert dequantize(data, scale, form, out=out) is out and torch.equal(out, want)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 tensor"):
        dequantize(data, scale, form, out=out.bfloat16())


def _torch_dequantize(data, scale, form, dtype):
    """torch's element-by-element float8 → float32 conversion times the expanded scales, in
    fp32, rounded once to ``dtype``: the decode the tables replace."""
    *lead, rows, cols = data.shape
    n, r = math.prod(lead) * form.parts, rows // form.parts
    s = scale.reshape(n, -1, scale.shape[-1]).float()
    s = s.repeat_interleave(form.block[0], 1)[:, :r].repeat_interleave(form.block[1], 2)[..., :cols]
    return (data.reshape(n, r, cols).to(torch.float32) * s).to(dtype).reshape(data.shape)


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_byte_decodes_as_torch_converts_it(dtype):
    """All 256 bytes (subnormals, both zeros, the NaN bytes 0x7F / 0xFF) in blocks of scales
    that are ordinary, bf16-stored, subnormal, huge and 1: the same bits as torch's conversion."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    data = every.repeat(6).view(6, 256)  # one block per row: (1, 256) blocks
    scale = torch.tensor([[0.013], [2.0**-130], [3.0e36], [1.0], [0.75], [1.0e-4]])
    scale[4] = scale[4].bfloat16().float()
    form = BlockFormat((1, 256))
    got, want = (
        dequantize(data, scale, form, dtype=dtype),
        _torch_dequantize(data, scale, form, dtype),
    )
    assert torch.equal(_bits(got), _bits(want))
    assert torch.isnan(got[:, 0x7F]).all() and torch.isnan(got[:, 0xFF]).all()


@pytest.mark.parametrize(
    ("shape", "block", "parts"),
    [((4, 256, 384), (128, 128), 2), ((3, 2 * INTER, H), BLOCK, 2), ((300, 200), (128, 64), 1)],
)
def test_random_bytes_decode_as_torch_converts_them(shape, block, parts):
    """Random bytes (NaNs included) under random scales, blocks that tile the matrices and
    blocks that leave partial edges, bf16 and fp32: bit for bit torch's conversion."""
    g = torch.Generator().manual_seed(1)
    form = BlockFormat(block, parts)
    data = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    scale = torch.rand(form.scale_shape(shape), generator=g) * 10.0 ** torch.randint(
        -6, 3, form.scale_shape(shape), generator=g
    )
    for dtype in (torch.float32, torch.bfloat16):
        want = _torch_dequantize(data, scale, form, dtype)
        assert torch.equal(_bits(dequantize(data, scale, form, dtype=dtype)), _bits(want))


def test_dequantize_in_slices_equals_one_slice(monkeypatch):
    for shape, form in (
        ((3, 2 * INTER, H), BlockFormat(BLOCK, 2)),
        ((4, 256, 64), BlockFormat((8, 16), 2)),
    ):
        data, scale = quantize(_weights(*shape, seed=7), form)
        whole = dequantize(data, scale, form)
        monkeypatch.setattr("moe_parallel.fp8.CPU_SLICE_ELEMENTS", 1)  # one block row a slice
        assert torch.equal(dequantize(data, scale, form), whole)
        monkeypatch.setattr("moe_parallel.fp8.CPU_SLICE_ELEMENTS", 3 * 8 * 64)  # 3 block rows
        assert torch.equal(dequantize(data, scale, form), whole)
        monkeypatch.undo()


def test_fp8_linear_is_the_linear_of_the_dequantized_weight_and_saves_only_fp8():
    w = _weights(2 * INTER, H, seed=3)
    form = BlockFormat(BLOCK)
    data, scale = quantize(w, form)
    dense = _reference_dequantize(data, scale, BLOCK).requires_grad_()
    x = torch.randn(4, 7, H, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fp8_linear(x, FP8Weight(data, scale, form))
    # the FP8 bytes and the scales are saved; no tensor of the weight's shape in another dtype
    assert any(t.dtype == torch.float8_e4m3fn and t.shape == data.shape for t in saved)
    assert not [t for t in saved if t.shape == data.shape and t.dtype != torch.float8_e4m3fn]
    x_ref = x.detach().clone().requires_grad_()
    want = F.linear(x_ref, dense)
    assert torch.equal(y, want)
    g = torch.randn(y.shape)
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(gx, torch.autograd.grad(want, x_ref, g)[0])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_linear(x, FP8Weight(w, scale, form))


def _experts(seed):
    """E experts' fused gate/up [E, 2I, H] and down [E, H, I] in FP8, each with its own scales
    (the experts' magnitudes differ by up to 10x)."""
    gu, down = _weights(E, 2 * INTER, H, seed=seed), _weights(E, H, INTER, seed=seed + 2)
    forms = BlockFormat(BLOCK, 2), BlockFormat(BLOCK)
    return tuple(
        FP8Weight(*quantize(w, form), form) for w, form in zip((gu, down), forms, strict=True)
    )


def _lora(dtype, seed=9, rank=4):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (0.3 * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    return LoRAFactors(
        rand(E, rank, H), rand(E, 2 * INTER, rank), rand(E, rank, INTER), rand(E, H, rank), 0.5
    )


def _per_expert_loop(x, counts, gate_up, down, lora):
    """Each row through its expert's hand-dequantized, adapted weights (fp64)."""
    rows, start = [], 0
    for e, n in enumerate(counts):
        gate = _reference_dequantize(gate_up.data[e, :INTER], gate_up.scale[e, :3], BLOCK)
        up = _reference_dequantize(gate_up.data[e, INTER:], gate_up.scale[e, 3:], BLOCK)
        w_gu = torch.cat([gate, up]).double() + lora.scale * lora.gate_up_B[e] @ lora.gate_up_A[e]
        w_d = _reference_dequantize(down.data[e], down.scale[e], BLOCK).double()
        w_d = w_d + lora.scale * lora.down_B[e] @ lora.down_A[e]
        for m in range(start, start + n):
            g, u = (w_gu @ x[m]).chunk(2)
            rows.append(w_d @ (F.silu(g) * u))
        start += n
    return torch.stack(rows)


@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_fp8_experts_equal_the_per_expert_loop_over_dequantized_weights(path):
    counts = [3, 0, 5, 2]  # expert 1 gets no rows
    x32 = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(3))
    dtype = torch.float32 if path == "grouped" else torch.float64  # fp64 takes the loop
    if path == "grouped":
        assert grouped_mm_works(x32, H, INTER, 4)
    x = x32.to(dtype).requires_grad_()
    gate_up, down = _experts(seed=11)
    lora = _lora(dtype)
    got = expert_swiglu(x, torch.tensor(counts), gate_up, down, backend="torch", lora=lora)
    x_ref = x32.double().requires_grad_()
    ref_lora = _lora(torch.float64)
    want = _per_expert_loop(x_ref, counts, gate_up, down, ref_lora)
    tol = {"rtol": 1e-4, "atol": 1e-5} if path == "grouped" else {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(got.double(), want, **tol)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(4))
    ours = torch.autograd.grad(got, (x, *lora[:4]), g.to(got.dtype))
    theirs = torch.autograd.grad(want, (x_ref, *ref_lora[:4]), g.double())
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, **tol)
    with pytest.raises(ValueError, match="FP8 expert weights run on the torch backend"):
        expert_swiglu(x, torch.tensor(counts), gate_up, down, backend="te")


def test_quantized_moe_block_equals_the_block_with_dequantized_weights():
    torch.manual_seed(0)
    theirs = MoE(H, E, 2, INTER, 8, init_std=0.3)
    ours = MoE(H, E, 2, INTER, 8, init_std=0.3)
    ours.load_state_dict(theirs.state_dict())
    assert quantize_experts(ours, BLOCK) == ["experts"]
    experts = ours.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_proj_scale_inv.shape == (E, 2 * 3, 6)
    assert not any(p.requires_grad for n, p in experts.named_parameters() if "proj" in n)
    gate_up, down = experts._local_weights()
    with torch.no_grad():  # the reference holds the dequantized weights in fp32
        theirs.experts.gate_up_proj.copy_(dequantize(gate_up.data, gate_up.scale, gate_up.form))
        theirs.experts.down_proj.copy_(dequantize(down.data, down.scale, down.form))
    add_expert_lora(ours, LoRASpec(2, 4.0))
    x = torch.randn(2, 9, H, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, want = ours(x), theirs(x_ref)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    torch.autograd.grad(y.sum(), x)  # frozen FP8 weights: only x (and adapters) get gradients
    torch.testing.assert_close(
        torch.autograd.grad(ours(x).sum(), x)[0], torch.autograd.grad(want.sum(), x_ref)[0]
    )
    with pytest.raises(ValueError, match="already held in FP8"):
        quantize_experts(ours, BLOCK)
