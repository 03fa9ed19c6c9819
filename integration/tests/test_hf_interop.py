"""Transformers checkpoints in and out: start from one, export one that transformers loads."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import hf_forward, tiny

from qwen35_trainer import build_config, build_model, global_batch, train


def _logits(model, batch):
    with torch.no_grad():
        return hf_forward(model, batch).logits


def test_start_from_a_transformers_checkpoint(tmp_path):
    r = tiny()
    torch.manual_seed(123)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(build_config(r.model))
    hf.save_pretrained(tmp_path)
    ours = build_model(tiny(f"model.weights={tmp_path}").model)
    theirs = hf.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in ours.state_dict().items())
    batch = global_batch(r.model, r.data, 0, step=0, dp=1)
    torch.testing.assert_close(_logits(ours, batch), _logits(hf, batch), rtol=1e-5, atol=1e-6)


def test_export_after_training_loads_in_transformers(tmp_path):
    """Trained packed (the tiny recipe's default): the exported directory is a plain
    transformers checkpoint (no trace of the packed attention) with the trained weights."""
    r = tiny("train.steps=2", f"train.export_dir={tmp_path}")
    assert r.data.packing
    result = train(r)
    assert "cp_varlen_attn" not in (tmp_path / "config.json").read_text()
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path)
    trained = result.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    fresh = build_model(tiny(f"model.weights={tmp_path}").model)  # ours, unadapted
    batch = global_batch(r.model, r.data, 0, step=5, dp=1)
    torch.testing.assert_close(_logits(loaded, batch), _logits(fresh, batch), rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path):
    torch.manual_seed(0)
    other = tiny("model.text.num_experts=4")
    transformers.Qwen3_5MoeForConditionalGeneration(build_config(other.model)).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match=r"does not fit the recipe.s model .* expected"):
        build_model(tiny(f"model.weights={tmp_path}").model)


def test_export_command_writes_a_training_checkpoint_for_transformers(tmp_path, capsys):
    """``qwen35-train export``: a DCP checkpoint of a run (weights + optimizer) becomes a
    transformers directory holding the run's final weights."""
    from qwen35_trainer.cli import main

    ckpt = tmp_path / "ckpt"
    result = train(tiny("train.steps=2", f"train.checkpoint_dir={ckpt}"))
    out = tmp_path / "hf"
    assert main(["export", "tiny", str(ckpt), str(out)]) == 0
    assert f"exported step 2 of {ckpt / 'step_000002'}" in capsys.readouterr().out
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(out)
    trained = result.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())


def test_export_command_refuses_a_directory_without_a_checkpoint(tmp_path, capsys):
    from qwen35_trainer.cli import main

    assert main(["export", "tiny", str(tmp_path), str(tmp_path / "hf")]) == 2
    assert "neither a checkpoint nor a directory holding one" in capsys.readouterr().err
