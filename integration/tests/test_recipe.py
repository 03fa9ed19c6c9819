"""Recipes: base derivation, overrides, and clear errors for anything that would be dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY, tiny

from qwen35_trainer import build_config, load_recipe, recipe_from_dict
from qwen35_trainer.demo.dataset import demo_dir
from qwen35_trainer.recipe import builtin_recipes, recipe_path
from qwen35_trainer.supervise.console import input_lines


def test_tiny_recipe_loads_with_types():
    r = tiny()
    assert r.train.steps > 0 and isinstance(r.train.lr, float)
    assert r.data.image_grids[0] == (1, 4, 4)
    assert r.train.betas == (0.9, 0.95)
    config = build_config(r.model)
    assert config.text_config.num_experts == r.model.text["num_experts"]
    assert config.image_token_id == r.model.image_token_id


def test_base_is_merged_key_by_key_and_overrides_apply_last(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {TINY}\nmodel:\n  text:\n    num_experts: 4\ntrain:\n  steps: 3\n")
    r = load_recipe(child, ["train.lr=0.5", "data.image_grids=[[1, 2, 2]]"])
    base = tiny()
    assert r.model.text["num_experts"] == 4
    assert r.model.text["hidden_size"] == base.model.text["hidden_size"]  # kept from the base
    assert (r.train.steps, r.train.lr) == (3, 0.5)
    assert r.data.image_grids == ((1, 2, 2),)
    assert r.data.samples_per_rank == base.data.samples_per_rank


def test_paths_are_relative_to_the_recipe_file_that_states_them(tmp_path, monkeypatch):
    """A base in another folder, a derived recipe, an override: each relative input path
    resolves against the file (or, for ``--set``, the working directory) that states it;
    outputs stay relative to the working directory; a ``builtin:`` path becomes the demo
    folder's file, once, when the recipe is built (every reader sees a local path)."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "project").mkdir()
    (tmp_path / "shared" / "base.yaml").write_text(
        f"base: {TINY}\ndata:\n  path: data/train.jsonl\n  eval_path: builtin:demo/heldout.jsonl\n"
    )
    (tmp_path / "project" / "run.yaml").write_text(
        "base: ../shared/base.yaml\ndata:\n  processor: ./proc\ntrain:\n  output_dir: runs/x\n"
    )
    monkeypatch.chdir(tmp_path)
    r = load_recipe("project/run.yaml")
    assert r.data.path == str(tmp_path / "shared" / "data" / "train.jsonl")
    assert r.data.processor == str(tmp_path / "project" / "proc")
    assert r.data.eval_path == str(demo_dir() / "heldout.jsonl")
    assert Path(r.data.eval_path).is_file()
    assert f"data.eval_path: built-in {r.data.eval_path}" in input_lines(r)  # the run's header
    with pytest.raises(ValueError, match=r"eval_path: 'builtin:demox/a.jsonl' names no built-in"):
        load_recipe("project/run.yaml", ["data.eval_path=builtin:demox/a.jsonl"])
    assert r.train.output_dir == "runs/x"
    r = load_recipe("project/run.yaml", ["data.path=mine.jsonl", "model.weights=~/w"])
    assert r.data.path == str(tmp_path / "mine.jsonl")
    assert r.model.weights == str(Path.home() / "w")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.stpes=3"], r"unknown recipe key\(s\) \['train.stpes'\]"),
        (["trian.steps=3"], r"unknown recipe section\(s\) \['trian'\]"),
        (["train.steps=three"], r"train.steps: expected int, got 'three'"),
        (["train.betas=[0.9]"], r"train.betas: expected 2 items"),
        (["data.image_grids=[[1, 2]]"], r"data.image_grids\[0\]: expected 3 items"),
        (["train.steps"], r"an override is section.key=value"),
    ],
)
def test_bad_recipes_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(*overrides)


def test_base_cycle_and_missing_model(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("base: b.yaml\n")
    b.write_text("base: a.yaml\n")
    with pytest.raises(ValueError, match="recipe base cycle"):
        load_recipe(a)
    with pytest.raises(ValueError, match="needs a 'model' section"):
        recipe_from_dict({"train": {"steps": 1}})


def test_model_fields_are_checked_against_transformers():
    with pytest.raises(
        ValueError, match=r"Qwen3_5MoeTextConfig has no field\(s\) \['intermediate_sise'\]"
    ):
        build_config(tiny("model.text.intermediate_sise=3").model)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 128\)"):
        build_config(tiny("model.image_token_id=500").model)


def test_bad_train_values_are_refused():
    for override, message in [
        ("train.grad_clip=0", r"train.grad_clip must be > 0, or null"),
        ("train.grad_clip=-1", r"train.grad_clip must be > 0"),
        ("train.dtype=float16", r"train.dtype must be one of \('float32', 'bfloat16'\)"),
        ("train.grad_accum_steps=0", r"train.grad_accum_steps must be >= 1"),
        ("data.text_only=[2, 3]", r"data.text_only must be \[period, count\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            tiny(override)
    assert tiny("train.grad_clip=null").train.grad_clip is None
    with pytest.raises(ValueError, match=r"train.checkpoint_every must be >= 0"):
        tiny("train.checkpoint_every=-1")
    from qwen35_trainer.train.loop import check_run

    nowhere = tiny("train.checkpoint_every=2")  # loads: export and data check do not save
    with pytest.raises(ValueError, match=r"train.checkpoint_every=2 but neither"):
        check_run(nowhere, 1)  # what training refuses (the CLI gives a run folder)
    with pytest.raises(ValueError, match=r"train.steps must be >= 1.*; train.lr must be >= 0"):
        tiny("train.steps=0", "train.lr=-1")  # every bad value in one message


def test_model_shapes_that_do_not_fit_are_refused_before_building():
    with pytest.raises(
        ValueError,
        match=r"expected model.vision.out_hidden_size equals "
        r"model.text.hidden_size .*vision hidden 32, heads 4, "
        r"out 48",
    ):
        build_config(tiny("model.vision.out_hidden_size=48").model)
    with pytest.raises(
        ValueError,
        match=r"transformers refuses the config: .*`num_hidden_layers` "
        r"\(3\) must be equal to the number of `layer_types`",
    ):
        build_config(tiny("model.text.num_hidden_layers=3").model)
    with pytest.raises(ValueError, match=r"num_key_value_heads divides num_attention_heads"):
        build_config(tiny("model.text.num_key_value_heads=3").model)
    with pytest.raises(
        ValueError,
        match=r"model.weights: '/missing/dir' is neither a transformers checkpoint "
        r"directory .* nor a torch Distributed Checkpoint folder",
    ):
        build_config(tiny("model.weights=/missing/dir").model)


@pytest.mark.parametrize("name", builtin_recipes())
def test_every_builtin_recipe_loads_and_its_model_config_builds(name):
    recipe = load_recipe(recipe_path(name))
    config = build_config(recipe.model)
    assert config.text_config.num_hidden_layers >= 2
