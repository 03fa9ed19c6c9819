"""After ``swap_moe_blocks``, transformers' own model returns the same loss, ``aux_loss`` and
gradients with ``output_router_logits=True`` as before the swap — also when the model already ran
(its output-recording hooks were installed before the swap); the adapter's checks name the
transformers version and the missing piece."""

from __future__ import annotations

import copy

import pytest
import torch

from dist_testkit import assert_close
from moe_parallel import MoE, swap_moe_blocks
from moe_parallel.transformers import check_transformers

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf  # noqa: E402


def _tiny_lm(seed=0):
    config = transformers.Qwen3_5MoeTextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, router_aux_loss_coef=0.1,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _run(model, ids):
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    return out, dict(zip([n for n, _ in model.named_parameters()], grads, strict=True))


@pytest.mark.parametrize("ran_before_swap", [False, True])
def test_transformers_aux_loss_and_grads_survive_the_swap(ran_before_swap):
    reference = _tiny_lm()
    ours = copy.deepcopy(reference)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    if ran_before_swap:
        ours(input_ids=ids, output_router_logits=True)  # installs transformers' recording hooks
    paths = swap_moe_blocks(ours, expert_backend="torch")
    assert paths == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(isinstance(ours.get_submodule(p), MoE) for p in paths)
    want, want_grads = _run(reference, ids)
    got, got_grads = _run(ours, ids)
    assert len(got.router_logits) == 2
    assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=1e-7, name="aux_loss")
    assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-7, name="loss (CE + coef * aux)")
    assert want.aux_loss > 0
    assert set(got_grads) == set(want_grads)  # the state dict names did not change
    for name, g in want_grads.items():
        assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6, name=f"grad {name}")


def test_a_model_without_blocks_or_config_is_refused():
    with pytest.raises(ValueError, match="has no Qwen3_5MoeSparseMoeBlock to replace"):
        swap_moe_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    holder = torch.nn.Module()
    holder.block = hf.Qwen3_5MoeSparseMoeBlock(_tiny_lm().config)
    with pytest.raises(ValueError, match=r"has no \.config"):
        swap_moe_blocks(holder)


@pytest.mark.parametrize("piece", ["Qwen3_5MoeTopKRouter", "_can_record_outputs"])
def test_a_changed_internal_is_named_with_the_version(monkeypatch, piece):
    if piece == "_can_record_outputs":
        monkeypatch.setattr(hf.Qwen3_5MoePreTrainedModel, "_can_record_outputs", {})
    else:
        monkeypatch.delattr(hf, piece)
    with pytest.raises(
        ImportError, match=f"transformers {transformers.__version__} changed"
    ) as err:
        check_transformers()
    assert piece in str(err.value)
