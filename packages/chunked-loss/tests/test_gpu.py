"""CUDA: parity with the float64 reference and the peak-memory bound from allocator stats."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _reference import make_inputs, reference

from chunked_loss import chunked_cross_entropy, linear_cross_entropy
from dist_testkit import assert_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gif", [True, False], ids=["grad_in_forward", "recompute"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_cuda_parity(dtype, gif, compiled):
    hidden, weight, bias, labels = make_inputs(300, 64, 1001)
    leaves = [t.cuda().to(dtype).requires_grad_() for t in (hidden, weight, bias)]
    loss = linear_cross_entropy(
        leaves[0],
        leaves[1],
        labels.cuda(),
        bias=leaves[2],
        chunk_size=64,
        grad_in_forward=gif,
        compiled=compiled,
    )
    loss.backward()
    rounded = [t.detach().float().cpu() for t in leaves]  # the same (bf16-rounded) inputs
    ref_loss, ref_grads = reference(rounded[0], rounded[1], labels, bias=rounded[2])
    rtol = 1e-4 if dtype == torch.float32 else 1e-2
    assert_close(loss.cpu(), ref_loss, rtol=rtol, atol=0.0, name="loss")
    for leaf, rg in zip(leaves, ref_grads, strict=True):
        tol = (1e-4 if dtype == torch.float32 else 2e-2) * float(rg.abs().max())
        assert_close(leaf.grad.float().cpu(), rg, rtol=0.0, atol=tol)


def _peak_extra(fn, *tensors):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*tensors).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("gif", [True, False], ids=["grad_in_forward", "recompute"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_cuda_peak_memory_is_bounded(gif, compiled):
    n, h, v = 8192, 256, 32000
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (n,), device="cuda")
    ours = _peak_extra(
        lambda a, b: linear_cross_entropy(
            a, b, labels, chunk_size=512, grad_in_forward=gif, compiled=compiled
        ),
        hidden,
        weight,
    )
    hidden.grad = weight.grad = None
    naive = _peak_extra(lambda a, b: F.cross_entropy((a @ b.T).float(), labels), hidden, weight)
    assert ours * 4 < naive, (ours, naive)


def test_cuda_chunked_cross_entropy_bf16():
    logits = (3 * torch.randn(512, 5000, device="cuda")).bfloat16().requires_grad_()
    labels = torch.randint(0, 5000, (512,), device="cuda")
    loss = chunked_cross_entropy(logits, labels, chunk_size=100)
    loss.backward()
    ref_logits = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(ref_logits, labels)
    ref.backward()
    assert_close(loss, ref, rtol=1e-3, atol=0.0)
    assert_close(
        logits.grad, ref_logits.grad, rtol=0.0, atol=1e-2 * float(ref_logits.grad.abs().max())
    )
