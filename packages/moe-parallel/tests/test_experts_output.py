"""The routed experts return a fresh tensor, never a view: FSDP2 registers its pre-backward
hook on a wrapped module's outputs, and an in-place op on a returned view would drop it (torch
warns "FSDP2-wrapped module ... returned a view tensor"; the workspace's test configuration
makes that warning an error). The output equals the assignment-order gather it replaces."""

from __future__ import annotations

import torch

from moe_parallel import MoE


def test_experts_output_is_not_a_view_and_is_in_assignment_order():
    torch.manual_seed(0)
    moe = MoE(32, 8, 3, 16, 16, init_std=0.3).double()  # fp64: the sums' order does not show
    x_NH = torch.randn(20, 32, dtype=torch.float64, requires_grad=True)
    top_i_NK = torch.randint(0, 8, (20, 3))
    y_NKH = moe.experts(x_NH, top_i_NK)
    assert y_NKH._base is None and y_NKH.shape == (20, 3, 32)
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    rows = []  # each assignment: its token through its expert's SwiGLU, one at a time
    for n in range(20):
        for k in range(3):
            e = int(top_i_NK[n, k])
            gate, up = (gate_up[e] @ x_NH[n]).chunk(2)
            rows.append(down[e] @ (torch.nn.functional.silu(gate) * up))
    expected_NKH = torch.stack(rows).view(20, 3, 32)
    torch.testing.assert_close(y_NKH, expected_NKH, rtol=1e-12, atol=1e-12)
    weights = (x_NH, gate_up, down)
    ours = torch.autograd.grad(y_NKH.square().sum(), weights)
    theirs = torch.autograd.grad(expected_NKH.square().sum(), weights)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_no_tokens_give_an_empty_output():
    moe = MoE(32, 8, 3, 16, 16, init_std=0.3)
    y_NKH = moe.experts(torch.randn(0, 32), torch.zeros(0, 3, dtype=torch.long))
    assert y_NKH.shape == (0, 3, 32) and y_NKH._base is None
