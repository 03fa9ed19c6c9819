"""LinearCrossEntropy (single process) and global_num_valid_tokens without a process group."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chunked_loss import LinearCrossEntropy, global_num_valid_tokens
from dist_testkit import assert_close, assert_grads_close


@pytest.mark.parametrize("gif", [None, True, False])
def test_wraps_lm_head_and_matches_linear_plus_cross_entropy(gif):
    torch.manual_seed(0)
    head = nn.Linear(12, 37)
    ref_head = copy.deepcopy(head)
    loss_mod = LinearCrossEntropy(
        head, chunk_size=5, label_smoothing=0.1, ignore_index=3, grad_in_forward=gif
    )
    assert loss_mod.lm_head is head
    hidden = torch.randn(2, 9, 12)
    labels = torch.randint(0, 37, (2, 9))
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    loss = loss_mod(h1, labels)
    ref = F.cross_entropy(
        ref_head(h2).reshape(-1, 37), labels.reshape(-1), ignore_index=3, label_smoothing=0.1
    )
    loss.backward()
    ref.backward()
    assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    assert_grads_close(loss_mod.lm_head, ref_head, rtol=1e-5, atol=1e-6)


def test_create_owns_a_head_and_passes_num_valid_tokens():
    loss_mod = LinearCrossEntropy.create(6, 10, bias=True, dtype=torch.float64)
    assert isinstance(loss_mod.lm_head, nn.Linear) and loss_mod.lm_head.bias is not None
    assert loss_mod.lm_head.weight.dtype == torch.float64
    hidden = torch.randn(4, 6, dtype=torch.float64)
    labels = torch.tensor([1, 2, -100, 3])
    total = LinearCrossEntropy(loss_mod.lm_head, reduction="sum")(hidden, labels)
    assert_close(loss_mod(hidden, labels, num_valid_tokens=10), total / 10, rtol=1e-12, atol=0.0)
    assert "reduction='mean'" in repr(loss_mod)


def test_global_num_valid_tokens_single_process():
    mbs = [torch.tensor([[1, -100, 2]]), torch.tensor([[-100, -100, 5, 6]])]
    assert global_num_valid_tokens(mbs) == 4
    assert global_num_valid_tokens(mbs[0]) == 2
    assert global_num_valid_tokens(mbs[1], ignore_index=5) == 3
