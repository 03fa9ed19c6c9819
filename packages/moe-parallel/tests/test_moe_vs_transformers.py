"""Single-process MoE equals transformers' Qwen3_5MoeSparseMoeBlock (values, aux loss, grads)."""

from __future__ import annotations

import pytest
import torch

from dist_testkit import assert_close, assert_grads_close
from moe_parallel import MoE, expert_swiglu, load_balancing_loss
from moe_parallel.grouped import grouped_mm_works

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf  # noqa: E402
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (  # noqa: E402
    Qwen3_5MoeTextConfig,
)


def _config(**kw):
    base = dict(
        hidden_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
        router_aux_loss_coef=0.01,
    )
    base.update(kw)
    return Qwen3_5MoeTextConfig(**base)


def _pair(config, seed=0):
    torch.manual_seed(seed)
    hf_block = hf.Qwen3_5MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in hf_block.parameters():
            p.normal_(0.0, 0.3)
    ours = MoE.from_config(config)
    ours.load_state_dict(hf_block.state_dict())
    return hf_block, ours


def test_state_dict_keys_and_shapes_match():
    hf_block, ours = _pair(_config())
    theirs = {k: v.shape for k, v in hf_block.state_dict().items()}
    assert {k: v.shape for k, v in ours.state_dict().items()} == theirs


@pytest.mark.parametrize("inter", [8, 5], ids=["grouped_mm", "loop_fallback"])
def test_forward_aux_and_grads_equal_transformers(inter):
    config = _config(moe_intermediate_size=inter)
    hf_block, ours = _pair(config)
    x = torch.randn(3, 5, 16)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf, y_ours = hf_block(x_hf), ours(x_ours)
    assert_close(y_ours, y_hf, rtol=1e-5, atol=1e-6, name="output")
    logits = hf_block.gate(x_hf.view(-1, 16))[0]
    aux_hf = hf.load_balancing_loss_func((logits,), 8, 2)
    assert_close(ours.stats.aux_loss, aux_hf, rtol=1e-6, atol=1e-7, name="aux_loss")
    assert_close(ours.stats.router_logits, logits, name="router_logits")
    g = torch.randn_like(y_hf)
    ((y_hf * g).sum() + aux_hf).backward()
    ((y_ours * g).sum() + ours.stats.aux_loss).backward()
    assert_grads_close(ours, hf_block, rtol=1e-5, atol=1e-6)
    assert_close(x_ours.grad, x_hf.grad, rtol=1e-5, atol=1e-6, name="x.grad")
    top_i = torch.topk(logits, 2, dim=-1).indices.reshape(-1)
    assert torch.equal(ours.stats.tokens_per_expert, torch.bincount(top_i, minlength=8))


def test_the_grouped_path_is_really_taken_on_cpu():
    """The 'grouped_mm' cases above run the grouped GEMM, not the loop: the probe passes for fp32
    on CPU (torch 2.15), and the path survives an expanded (stride-0) output gradient."""
    assert grouped_mm_works(torch.ones(1, 16), 16, 8)
    assert not grouped_mm_works(torch.ones(1, 16), 16, 5)  # 5 * 4 B is not a multiple of 16
    gate_up = torch.randn(3, 16, 16, requires_grad=True)
    down = torch.randn(3, 16, 8, requires_grad=True)
    expert_swiglu(torch.randn(4, 16), torch.tensor([1, 0, 3]), gate_up, down).sum().backward()
    assert torch.count_nonzero(gate_up.grad[1]) == 0 and torch.count_nonzero(gate_up.grad[2]) > 0


def test_aux_loss_matches_hf_function_directly():
    logits = torch.randn(11, 8, requires_grad=True)
    ours = load_balancing_loss(logits, 3)
    ref = hf.load_balancing_loss_func((logits,), 8, 3)
    assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    ga = torch.autograd.grad(ours, logits)[0]
    gr = torch.autograd.grad(ref, logits)[0]
    assert_close(ga, gr, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("inter", [8, 5], ids=["grouped_mm", "loop_fallback"])
def test_idle_expert_gets_zero_grad_not_none(inter):
    gate_up = torch.randn(4, 2 * inter, 16, requires_grad=True)
    down = torch.randn(4, 16, inter, requires_grad=True)
    counts = torch.tensor([3, 0, 2, 0])
    x = torch.randn(5, 16)
    y = expert_swiglu(x, counts, gate_up, down)
    y.square().sum().backward()
    assert gate_up.grad is not None and down.grad is not None
    assert torch.count_nonzero(gate_up.grad[1]) == 0 and torch.count_nonzero(down.grad[3]) == 0
    assert torch.count_nonzero(gate_up.grad[0]) > 0


def test_zero_rows_still_give_zero_grads():
    gate_up = torch.randn(2, 16, 16, requires_grad=True)
    down = torch.randn(2, 16, 8, requires_grad=True)
    y = expert_swiglu(torch.zeros(0, 16), torch.zeros(2, dtype=torch.long), gate_up, down)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(gate_up.grad, torch.zeros_like(gate_up))
    assert torch.equal(down.grad, torch.zeros_like(down))


def test_bad_inputs_raise():
    moe = MoE(16, 8, 2, 8)
    with pytest.raises(ValueError, match=r"\[B, S, 16\]"):
        moe(torch.randn(4, 16))
    with pytest.raises(ValueError, match="top_k"):
        MoE(16, 4, 5, 8)
    with pytest.raises(ValueError, match="silu"):
        MoE.from_config(_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="counts_E"):
        expert_swiglu(
            torch.randn(3, 16), torch.tensor([3]), torch.randn(2, 16, 16), torch.randn(2, 16, 8)
        )
