"""Expert LoRA: the grouped adapters inside the expert computation equal a per-expert loop over
adapted weights ``W_e + s · B_e A_e`` (the delta formed, in fp64: the independent reference),
forward and backward, on shapes where no dimension cancels (H=20, 2I=24, I=12, r=8, E=6, a
zero-token expert); with ``B = 0`` the block is the base block bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_parallel import LoRAFactors, LoRASpec, MoE, add_expert_lora, expert_swiglu
from moe_parallel.grouped import grouped_mm_works

H, INTER, R, E = 20, 12, 8, 6


def _factors(dtype, seed=0, scale=0.75):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (0.3 * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    base = (rand(E, 2 * INTER, H), rand(E, H, INTER))
    lora = LoRAFactors(
        rand(E, R, H), rand(E, 2 * INTER, R), rand(E, R, INTER), rand(E, H, R), scale
    )
    return base, lora


def _per_expert_loop(x, counts, base, lora):
    """Each row through its expert's adapted weights, the delta formed explicitly."""
    (gate_up, down), s = base, lora.scale
    rows, start = [], 0
    for e, n in enumerate(counts):
        w_gu = gate_up[e] + s * lora.gate_up_B[e] @ lora.gate_up_A[e]
        w_d = down[e] + s * lora.down_B[e] @ lora.down_A[e]
        for m in range(start, start + n):
            gate, up = (w_gu @ x[m]).chunk(2)
            rows.append(w_d @ (F.silu(gate) * up))
        start += n
    return torch.stack(rows)


@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_grouped_adapters_equal_the_per_expert_loop(path):
    counts = [3, 0, 5, 1, 4, 2]  # expert 1 gets no rows
    x32 = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(3))
    if path == "grouped":
        assert grouped_mm_works(x32, H, INTER, R)
    x = x32.clone().requires_grad_()
    dtype = torch.float32 if path == "grouped" else torch.float64  # fp64 takes the loop
    base, lora = _factors(dtype)
    x_in = x if path == "grouped" else x32.double().requires_grad_()
    got = expert_swiglu(x_in, torch.tensor(counts), *base, backend="torch", lora=lora)
    ref_base, ref_lora = _factors(torch.float64)
    x_ref = x32.double().requires_grad_()
    want = _per_expert_loop(x_ref, counts, ref_base, ref_lora)
    # fp32 grouped GEMMs against fp64: fp32's accuracy; the fp64 loop: exact up to the order
    tol = {"rtol": 1e-4, "atol": 1e-5} if path == "grouped" else {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(got.double(), want, **tol)
    out_grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(4))
    ours = (x_in, *base, *lora[:4])
    theirs = (x_ref, *ref_base, *ref_lora[:4])
    for a, b in zip(
        torch.autograd.grad(got, ours, out_grad.to(got.dtype)),
        torch.autograd.grad(want, theirs, out_grad.double()),
        strict=True,
    ):
        torch.testing.assert_close(a.double(), b, **tol)
    grads = torch.autograd.grad(
        expert_swiglu(x_in, torch.tensor(counts), *base, lora=lora).sum(), lora[:4]
    )
    assert all(torch.count_nonzero(g[1]) == 0 for g in grads)  # idle expert: zeros, not None


def test_zero_b_is_the_base_block_bit_for_bit():
    torch.manual_seed(0)
    base = MoE(H, E, 2, INTER, 8, init_std=0.3)
    adapted = MoE(H, E, 2, INTER, 8, init_std=0.3)
    adapted.load_state_dict(base.state_dict())
    assert add_expert_lora(adapted, LoRASpec(R, 16.0)) == ["experts"]
    x = torch.randn(2, 7, H)
    assert torch.equal(adapted(x), base(x))
    assert torch.equal(adapted.stats.aux_loss, base.stats.aux_loss)


def test_scale_dropout_and_refusals():
    assert LoRASpec(16, 32.0).scale == 2.0
    assert LoRASpec(16, 32.0, rslora=True).scale == 32.0 / math.sqrt(16)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        LoRASpec(0, 1.0)
    torch.manual_seed(0)
    moe = MoE(H, E, 2, INTER, init_std=0.3)
    add_expert_lora(moe, LoRASpec(R, 8.0, dropout=0.5))
    with torch.no_grad():
        moe.experts.lora_down_B.normal_()
    x = torch.randn(1, 9, H)
    moe.eval()
    evaluated = moe(x)
    assert torch.equal(moe(x), evaluated)  # no dropout in evaluation
    moe.train()
    assert not torch.equal(moe(x), evaluated)  # dropout on the adapters' input
    with pytest.raises(ValueError, match="already have LoRA adapters"):
        add_expert_lora(moe, LoRASpec(R, 8.0))
    with pytest.raises(ValueError, match="expert LoRA runs on the torch backend"):
        base, lora = _factors(torch.float32)
        expert_swiglu(
            torch.randn(2, H), torch.tensor([2, 0, 0, 0, 0, 0]), *base, backend="te", lora=lora
        )
