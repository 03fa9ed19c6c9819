"""The assembled model and objective equal transformers' own model: loss and every gradient.

Reference: ``Qwen3_5MoeForConditionalGeneration`` with the same weights, called with
``labels`` and ``output_router_logits=True`` (its loss is the mean next-token cross-entropy plus
``router_aux_loss_coef`` times its load-balancing loss over all layers' router logits of the
non-padding tokens). Ours: :func:`swap_moe_blocks` + :class:`TrainingObjective` (chunked
cross-entropy from hidden states, aux loss from ``MoE.stats``) on a padded multimodal batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from helpers import hf_forward, tiny

from dist_testkit import assert_close, assert_grads_close
from qwen35_trainer import TrainingObjective, build_config, global_batch, swap_moe_blocks
from qwen35_trainer.model.objective import shifted_labels


def _pair(recipe):
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(build_config(recipe.model))
    ours = copy.deepcopy(hf)
    swap_moe_blocks(ours, expert_backend="torch")
    return hf, ours


@pytest.mark.parametrize("chunk", [None, 7], ids=["default_chunk", "chunk7"])
def test_objective_equals_transformers_loss_and_grads(chunk):
    r = tiny()
    hf, ours = _pair(r)
    batch = global_batch(r.model, r.data, hf.config.text_config.pad_token_id, step=0, dp=2)
    out = hf_forward(hf, batch, labels=batch.labels, output_router_logits=True)
    objective = TrainingObjective(ours, loss_chunk_size=chunk)
    shares = objective(batch)
    assert shares.tokens == int((shifted_labels(batch) != -100).sum())
    coef = hf.config.text_config.router_aux_loss_coef
    assert_close(shares.aux, out.aux_loss, rtol=1e-6, atol=1e-7, name="aux loss")
    assert_close(shares.ce + coef * shares.aux, out.loss, rtol=1e-6, atol=1e-6, name="loss")
    out.loss.backward()
    (shares.ce + coef * shares.aux).backward()
    assert_grads_close(ours, hf, rtol=1e-4, atol=1e-6)
    assert all(p.grad is not None for p in ours.parameters())


def test_swap_keeps_the_state_dict_and_refuses_other_models():
    hf, ours = _pair(tiny())
    theirs = hf.state_dict()
    mine = ours.state_dict()
    assert list(mine) == list(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    with pytest.raises(ValueError, match="has no Qwen3_5MoeSparseMoeBlock"):
        swap_moe_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="needs the MoE blocks swapped"):
        TrainingObjective(hf)
