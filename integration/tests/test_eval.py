"""Held-out evaluation: its loss equals transformers' own model's loss (labels +
``output_router_logits``) on the same held-out batch with the trained weights, it is
evaluated exactly every ``eval_every`` steps and after the last, and the held-out batches are
not training batches."""

from __future__ import annotations

import torch
import transformers
from helpers import hf_forward, tiny

from qwen35_trainer import build_config, train
from qwen35_trainer.data import HELD_OUT_INDEX, global_batch


def test_eval_loss_is_transformers_loss_on_the_held_out_batch():
    recipe = tiny("train.steps=3", "train.eval_every=2", "model.expert_backend=torch")
    result = train(recipe)
    assert [log.eval_loss is not None for log in result.logs] == [False, True, True]
    config = build_config(recipe.model)  # transformers' own attention, not the packed one
    reference = transformers.Qwen3_5MoeForConditionalGeneration(config)
    reference.load_state_dict(result.state_dict())
    batch = global_batch(
        recipe.model,
        recipe.data,
        config.text_config.pad_token_id,
        step=0,
        dp=1,
        offset=HELD_OUT_INDEX,
    )
    train_batch = global_batch(recipe.model, recipe.data, config.text_config.pad_token_id, 0, 1)
    assert not torch.equal(batch.pixel_values[:8], train_batch.pixel_values[:8])  # other samples
    with torch.no_grad():
        out = hf_forward(reference, batch, labels=batch.labels, output_router_logits=True)
    torch.testing.assert_close(result.logs[-1].eval_loss, float(out.loss), rtol=1e-4, atol=0)
    assert result.logs[-1].eval_loss not in [log.loss for log in result.logs]
