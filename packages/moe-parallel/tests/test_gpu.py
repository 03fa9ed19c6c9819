"""CUDA path: the grouped GEMM (bf16 and fp32, whichever ``torch._grouped_mm`` supports on the
device) equals the exact per-expert loop forward and backward, and idle experts get zero grads.
Skipped without CUDA. TransformerEngine's grouped linear is not an expert backend of this
package (see README), so there is no TE test here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_testkit import assert_close
from moe_parallel import expert_swiglu
from moe_parallel.grouped import grouped_mm_works

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_grouped_equals_loop_with_idle_expert(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([40, 0, 17, 71], device="cuda")
    x = torch.randn(128, 64, device="cuda", dtype=dtype, generator=g)
    weights = [
        torch.randn(4, 64, 64, device="cuda", dtype=dtype, generator=g) * 0.1,
        torch.randn(4, 64, 32, device="cuda", dtype=dtype, generator=g) * 0.1,
    ]
    ours = [w.clone().requires_grad_() for w in weights]
    ref = [w.float().clone().requires_grad_() for w in weights]
    y = expert_swiglu(x, counts, *ours)
    y_ref = _loop_ref(x.float(), counts, *ref)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    assert_close(y.float(), y_ref, **tol)
    y.float().square().sum().backward()
    y_ref.square().sum().backward()
    for a, b in zip(ours, ref, strict=True):
        assert a.grad is not None
        assert_close(a.grad.float(), b.grad, **tol)
    assert torch.count_nonzero(ours[0].grad[1]) == 0
    if dtype == torch.bfloat16:
        assert grouped_mm_works(x, 64, 32), "bf16 grouped GEMM should run on CUDA"
