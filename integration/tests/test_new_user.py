"""The path a new user takes, as a script: a small Qwen3.5 MoE-VLM saved by transformers' own
``save_pretrained`` (with its processor and chat template), a recipe written in the README's
words (``base:`` a built-in recipe's name, ``model.path``, the rows, pipeline parallelism),
``qwen35-train`` on it — PP 2 over 2 workers it starts itself, evaluating and exporting — and the
export loaded by transformers; plus the defaults and messages that cost that user a retry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
import yaml
from chat_fixtures import checkpoint_dir
from pp_checks import assert_same_folder

from qwen35_trainer import build_model, load_recipe
from qwen35_trainer.cli import main
from qwen35_trainer.demo.dataset import make_demo
from qwen35_trainer.recipe import recipe_from_dict
from qwen35_trainer.train.export import export_checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``(checkpoint folder, demo rows folder)``."""
    demo = make_demo(tmp_path_factory.mktemp("demo"), train_rows=8, heldout_rows=2)
    return checkpoint_dir(tmp_path_factory.mktemp("ckpt"), demo / "processor"), demo


def _write(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_a_new_user_trains_pp2_from_a_saved_model_evaluates_and_exports(folders, tmp_path, capfd):
    checkpoint, demo = folders
    out = tmp_path / "out"
    recipe = _write(
        tmp_path / "recipe.yaml",
        {
            "base": "base",
            "model": {"path": str(checkpoint)},
            "data": {
                "path": str(demo / "train.jsonl"),
                "eval_path": str(demo / "heldout.jsonl"),
                "pack_length": 256,
                "global_batch": 2,
            },
            "parallel": {"pp": 2, "dp": 1, "cp": 1, "ep": 1},
            "train": {
                "steps": 2,
                "grad_accum_steps": 2,
                "eval_every": 2,
                "eval_steps": 1,
                "lr": 0.01,
                "checkpoint_dir": str(out / "checkpoints"),
                "export_dir": str(out / "served"),
                "output_dir": str(out / "run"),
            },
        },
    )
    assert main([str(recipe)]) == 0
    said, err = capfd.readouterr()
    assert "starting 2 local workers: pp 2 (--nproc N changes dp)" in err, err
    assert "layout: pp 2 x dp_replicate 1 x dp 1" in err, err
    assert " eval " in said.splitlines()[-2] and "accuracy" in said.splitlines()[-2], said
    served = out / "served"
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(served)
    assert set(loaded.state_dict()) == set(build_model(load_recipe(recipe).model).state_dict())
    assert json.loads((served / "config.json").read_text())["architectures"] == [
        "Qwen3_5MoeForConditionalGeneration"
    ]
    # the stages' export is the one-process export of the run's last checkpoint
    export_checkpoint(load_recipe(recipe), out / "checkpoints" / "step_000002", tmp_path / "one")
    assert_same_folder(served, tmp_path / "one")


def test_packing_follows_the_data(folders):
    """``data.packing`` unset: true with a dataset (the only value it takes), false for the
    synthetic stream; false with a dataset is refused naming the key."""
    checkpoint, demo = folders
    rows = {"path": str(demo / "train.jsonl"), "pack_length": 256}
    model = {"path": str(checkpoint)}
    assert recipe_from_dict({"model": model, "data": rows}).data.packing is True
    assert recipe_from_dict({"model": model, "data": {}}).data.packing is False
    with pytest.raises(ValueError, match=r"data.packing.*true with a dataset"):
        recipe_from_dict({"model": model, "data": {**rows, "packing": False}})


def test_a_recipe_derives_from_a_built_in_by_name(tmp_path):
    mine = _write(tmp_path / "mine.yaml", {"base": "tiny", "train": {"steps": 7}})
    assert load_recipe(mine) == load_recipe("tiny", ["train.steps=7"])
    bad = _write(tmp_path / "bad.yaml", {"base": "tinny"})
    with pytest.raises(
        ValueError, match=r"base 'tinny' is neither a file .* built-in recipe \(built-in: base, "
    ):
        load_recipe(bad)


def test_training_the_mtp_head_of_a_model_without_one_says_it_is_absent():
    recipe = load_recipe(
        "tiny", ["model.mtp_layers=0", "model.lora={rank: 4, train_modules: [mtp]}"]
    )
    with pytest.raises(ValueError) as err:
        build_model(recipe.model)
    assert "the model has no multi-token-prediction head" in str(err.value)
    assert ", mtp)" not in str(err.value)  # not offered as an example


def test_peft_is_one_extra_away():
    """The README's PEFT check needs ``peft``: the trainer's ``peft`` extra brings it."""
    import tomllib

    root = Path(__file__).parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("peft") for d in extras["optional-dependencies"]["peft"])
    assert "--extra peft" in (root / "README.md").read_text()
