"""CUDA paths: the grouped GEMM (bf16 and fp32, whichever ``torch._grouped_mm`` supports on the
device) and TransformerEngine's ``GroupedLinear`` (``backend="te"``, needs the ``gpu`` extra)
equal the exact per-expert loop forward and backward, and idle experts get zero (never ``None``,
never stale-buffer) grads. Skipped without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from dist_testkit import assert_close
from moe_parallel import MoE, expert_swiglu
from moe_parallel.grouped import grouped_mm_works

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
needs_te = pytest.mark.skipif(
    not HAS_TE, reason="needs transformer_engine (the te extra: moe-parallel[te])"
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _loop_ref(x, counts, gate_up, down):
    out = []
    for e, rows in enumerate(torch.split(x, counts.tolist())):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        out.append(F.linear(F.silu(gate) * up, down[e]))
    return torch.cat(out)


def _check_against_loop(dtype, backend):
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([40, 0, 17, 71], device="cuda")
    x = torch.randn(128, 64, device="cuda", dtype=dtype, generator=g)
    weights = [
        torch.randn(4, 64, 64, device="cuda", dtype=dtype, generator=g) * 0.1,
        torch.randn(4, 64, 32, device="cuda", dtype=dtype, generator=g) * 0.1,
    ]
    ours = [w.clone().requires_grad_() for w in weights]
    ref = [w.float().clone().requires_grad_() for w in weights]
    y = expert_swiglu(x, counts, *ours, backend=backend)
    y_ref = _loop_ref(x.float(), counts, *ref)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    assert_close(y.float(), y_ref, **tol)
    y.float().square().sum().backward()
    y_ref.square().sum().backward()
    for a, b in zip(ours, ref, strict=True):
        assert a.grad is not None
        assert_close(a.grad.float(), b.grad, **tol)
    assert torch.count_nonzero(ours[0].grad[1]) == 0
    assert torch.count_nonzero(ours[1].grad[1]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_grouped_equals_loop_with_idle_expert(dtype):
    _check_against_loop(dtype, "torch")
    if dtype == torch.bfloat16:
        x = torch.ones(1, 64, device="cuda", dtype=dtype)
        assert grouped_mm_works(x, 64, 32), "bf16 grouped GEMM should run on CUDA"


@needs_te
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_te_grouped_linear_equals_loop_with_idle_expert(dtype):
    _check_against_loop(dtype, "te")


@needs_te
def test_te_backend_zero_token_expert_over_repeated_steps():
    """The idle expert's grad is exactly zero on every step, also after other experts' buffers
    were freed and reused (what TE's uninitialised wgrad buffer could otherwise expose)."""
    torch.manual_seed(0)
    te_moe = MoE(64, 8, 2, 32, 32, init_std=0.1, expert_backend="te").cuda().bfloat16()
    ref = MoE(64, 8, 2, 32, 32, init_std=0.1, expert_backend="torch").cuda().bfloat16()
    ref.load_state_dict(te_moe.state_dict())
    with torch.no_grad():
        for moe in (te_moe, ref):
            moe.gate.weight[:, 0] = 0.5
            moe.gate.weight[7, 0] = -8.0
    for step in range(3):
        x = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16)
        x[..., 0] = 3.0
        g = torch.randn(x.shape, device="cuda")
        for moe in (te_moe, ref):
            moe.zero_grad(set_to_none=True)
            (moe(x).float() * g).sum().backward()
        assert te_moe.stats.tokens_per_expert[7] == 0, step
        for (name, p), q in zip(te_moe.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None, (step, name)
            assert torch.isfinite(p.grad).all(), (step, name)
            assert_close(p.grad.float(), q.grad.float(), rtol=5e-2, atol=2e-2, name=name)
        assert torch.count_nonzero(te_moe.experts.gate_up_proj.grad[7]) == 0
        assert torch.count_nonzero(te_moe.experts.down_proj.grad[7]) == 0


def test_fp8_experts_on_cuda_equal_the_dequantized_loop_in_bf16():
    """Frozen FP8 experts on CUDA (the dequantize path: there is no FP8 GEMM path yet) in bf16
    against the fp32 loop over the dequantized weights: bf16 tolerance forward and backward,
    the FP8 bytes (never a dequantized weight) saved for the backward."""
    from moe_parallel import BlockFormat, FP8Weight, dequantize, quantize

    g = torch.Generator(device="cuda").manual_seed(1)
    counts = torch.tensor([40, 0, 17, 71], device="cuda")
    x = torch.randn(128, 256, device="cuda", generator=g)
    forms = BlockFormat((128, 128), 2), BlockFormat((128, 128))
    weights = [0.02 * torch.randn(4, 256, 256, device="cuda", generator=g) for _ in forms]
    fp8 = [FP8Weight(*quantize(w, f), f) for w, f in zip(weights, forms, strict=True)]
    dense = [dequantize(w.data, w.scale, w.form) for w in fp8]
    x_bf16 = x.bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = expert_swiglu(x_bf16, counts, *fp8, backend="torch")
    assert not [t for t in saved if t.shape == (4, 256, 256) and t.dtype != torch.float8_e4m3fn]
    x_ref = x.clone().requires_grad_()
    want = _loop_ref(x_ref, counts, *dense)
    assert_close(y.float(), want, rtol=2e-2, atol=2e-2, name="fp8 output")
    g_out = torch.randn(want.shape, device="cuda", generator=g)
    (gx,) = torch.autograd.grad(y, x_bf16, g_out.bfloat16())
    (gx_ref,) = torch.autograd.grad(want, x_ref, g_out)
    assert_close(gx.float(), gx_ref, rtol=2e-2, atol=2e-2, name="fp8 x.grad")
