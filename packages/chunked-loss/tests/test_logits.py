"""chunked_cross_entropy vs F.cross_entropy on float64 logits; nothing fp32 [N, V] is saved."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chunked_loss import chunked_cross_entropy
from dist_testkit import assert_close


def inputs(n, v, *, ignore_index=-100, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, v, generator=g)).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = ignore_index
    return logits, labels


def ours_and_reference(logits, labels, reduction, ignore_index=-100, **kw):
    x = logits.clone().requires_grad_()
    loss = chunked_cross_entropy(x, labels, reduction=reduction, ignore_index=ignore_index, **kw)
    grad_out = torch.randn(loss.shape, generator=torch.Generator().manual_seed(3))
    loss.backward(grad_out)
    xr = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(
        xr.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        reduction="sum" if reduction == "mean" else reduction,
        ignore_index=ignore_index,
    )
    if reduction == "mean":
        ref = ref / max(int((labels != ignore_index).sum()), 1)
    ref = ref.reshape(loss.shape)
    ref.backward(grad_out.double())
    return loss, x.grad, ref, xr.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("n", "v", "chunk"), [(37, 29, 8), (16, 101, 1), (9, 13, None)])
def test_parity_fp32(reduction, n, v, chunk):
    logits, labels = inputs(n, v, seed=n)
    loss, grad, ref, ref_grad = ours_and_reference(logits, labels, reduction, chunk_size=chunk)
    assert_close(loss, ref, rtol=1e-5, atol=1e-5, name="loss")
    assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6, name="grad_logits")


def test_batch_seq_custom_ignore_and_num_valid_tokens():
    logits, labels = inputs(24, 11, ignore_index=2)
    logits, labels = logits.reshape(4, 6, 11), labels.reshape(4, 6)
    loss, grad, ref, ref_grad = ours_and_reference(logits, labels, "none", ignore_index=2)
    assert loss.shape == (4, 6)
    assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    total = chunked_cross_entropy(logits, labels, ignore_index=2, reduction="sum")
    mean = chunked_cross_entropy(logits, labels, ignore_index=2, num_valid_tokens=50)
    assert_close(mean, total / 50, rtol=1e-6, atol=0.0)


def test_all_ignored_is_zero_with_zero_grad():
    logits, labels = inputs(6, 7)
    labels[:] = -100
    for reduction in ("mean", "sum", "none"):
        x = logits.clone().requires_grad_()
        loss = chunked_cross_entropy(x, labels, reduction=reduction)
        loss.sum().backward()
        assert torch.equal(loss, torch.zeros_like(loss))
        assert torch.equal(x.grad, torch.zeros_like(x))


def test_bf16_logits_keep_their_dtype_and_save_no_fp32_copy():
    """bf16: loss within 1e-3 relative of the float64 loss of the same bf16 values, gradient
    within 1e-2·max|grad| (it is rounded to bf16); the only [N, V] tensor saved is the bf16 logits."""
    n, v = 64, 300
    logits, labels = inputs(n, v, dtype=torch.bfloat16)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    x = logits.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_cross_entropy(x, labels, chunk_size=16).backward()
    assert [s for s in saved if s[1] >= n * v] == [(torch.bfloat16, n * v)]
    assert x.grad.dtype == torch.bfloat16
    loss, grad, ref, ref_grad = ours_and_reference(logits, labels, "mean", chunk_size=16)
    assert_close(loss, ref, rtol=1e-3, atol=0.0)
    assert_close(grad, ref_grad, rtol=0.0, atol=1e-2 * float(ref_grad.abs().max()))


def test_double_backward_raises():
    logits, labels = inputs(5, 4)
    x = logits.clone().requires_grad_()
    loss = chunked_cross_entropy(x, labels)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(loss, x, create_graph=True)
