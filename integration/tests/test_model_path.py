"""``model.path``: a checkpoint directory written by transformers' own ``save_pretrained`` (its
processor and Qwen3.5's chat template beside it) is the source of truth — a recipe naming only
the directory builds exactly its config and weights and trains on multi-turn rows; a recipe
value that disagrees with config.json is one error naming both values; a deliberate change goes
under ``model.override`` and the run folder records it."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml
from chat_fixtures import checkpoint_dir

from qwen35_trainer import load_recipe, train
from qwen35_trainer.demo.dataset import make_demo
from qwen35_trainer.model import build_config, build_model
from qwen35_trainer.recipe import recipe_from_dict

ROWS = [
    {
        "messages": [
            {"role": "system", "content": "You describe pictures."},
            {
                "role": "user",
                "content": [
                    {"type": "image", "path": "images/000001.png"},
                    {"type": "text", "text": "colour?"},
                ],
            },
            {"role": "assistant", "content": "red", "reasoning_content": "the square is red"},
            {"role": "user", "content": "and the shape?"},
            {"role": "assistant", "content": "<think>\nfour equal sides\n</think>\n\na square"},
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "video",
                        "path": ["videos/000000/frame_0.png", "videos/000000/frame_1.png"],
                    },
                    {"type": "text", "text": "where does it go?"},
                ],
            },
            {"role": "assistant", "content": "down"},
        ]
    },
    {
        "tools": [{"type": "function", "function": {"name": "count", "parameters": {}}}],
        "messages": [
            {"role": "user", "content": "how many dots?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "count", "arguments": {"what": "dots"}},
                    }
                ],
            },
            {"role": "tool", "content": "2"},
            {"role": "assistant", "content": "two"},
        ],
    },
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    demo = make_demo(tmp_path_factory.mktemp("demo"), train_rows=4, heldout_rows=1)
    path = checkpoint_dir(tmp_path_factory.mktemp("ckpt"), demo / "processor")
    rows = demo / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path, rows


def _recipe(path, rows, tmp_path, extra=None):
    """A recipe of only the checkpoint directory, a dataset and a few train settings."""
    body = {
        "base": "base.yaml",
        "model": {"path": str(path)},
        "data": {"path": str(rows), "pack_length": 256, "global_batch": 1},
        "train": {"steps": 2, "lr": 0.01},
    }
    for dotted, value in (extra or {}).items():
        *parents, leaf = dotted.split(".")
        node = body
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    file = tmp_path / "recipe.yaml"
    from qwen35_trainer.recipe import BUILTIN_RECIPES

    body["base"] = str(BUILTIN_RECIPES / "base.yaml")
    file.write_text(yaml.safe_dump(body))
    return load_recipe(file)


def test_the_directory_gives_the_config_the_weights_and_the_processor(checkpoint, tmp_path):
    path, rows = checkpoint
    recipe = _recipe(path, rows, tmp_path)
    assert recipe.data.processor == str(path)
    ours, theirs = build_config(recipe.model), transformers.AutoConfig.from_pretrained(path)
    for section in ("text_config", "vision_config"):
        mine, saved = getattr(ours, section).to_dict(), getattr(theirs, section).to_dict()
        assert {k: mine[k] for k in saved} == saved, section
    assert ours.image_token_id == theirs.image_token_id
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(path).state_dict()
    model = build_model(recipe.model).state_dict()
    assert model.keys() == hf.keys()
    assert all(torch.equal(model[k], hf[k]) for k in hf)
    logs = train(recipe).logs
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(log.loss)) for log in logs)


def test_a_recipe_value_that_disagrees_is_one_error_with_both_values(checkpoint, tmp_path):
    path, rows = checkpoint
    with pytest.raises(
        ValueError,
        match=r"disagrees with the recipe .*model\.text\.hidden_size: "
        r"recipe 64, checkpoint 32; model\.image_token_id: recipe 1, checkpoint "
        r"261",
    ):
        _recipe(
            path,
            rows,
            tmp_path,
            {"model.text.hidden_size": 64, "model.image_token_id": 1, "model.text.num_experts": 8},
        )
    with pytest.raises(ValueError, match=r"model.text.hiden_size: recipe 32, checkpoint '\(absent"):
        _recipe(path, rows, tmp_path, {"model.text.hiden_size": 32})
    with pytest.raises(ValueError, match=r"model.override.text: neither config.json nor"):
        _recipe(path, rows, tmp_path, {"model.override.text.hiden_size": 32})


def test_an_override_applies_and_the_run_folder_records_it(checkpoint, tmp_path):
    path, rows = checkpoint
    recipe = _recipe(
        path,
        rows,
        tmp_path,
        {
            "model.override.text.router_aux_loss_coef": 0.5,
            "model.text.router_aux_loss_coef": 0.5,  # stating the overridden value is consistent
            "train.output_dir": str(tmp_path / "run"),
            "train.steps": 1,
        },
    )
    assert build_config(recipe.model).text_config.router_aux_loss_coef == 0.5
    train(recipe)
    saved = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())
    assert saved["model"]["override"] == {"text": {"router_aux_loss_coef": 0.5}}
    assert recipe_from_dict(saved) == recipe  # the resolved recipe loads back to itself


def test_plan_reads_the_shapes_from_the_directory(checkpoint, tmp_path):
    """``qwen35-train plan`` of a recipe with ``model.path`` counts the checkpoint's model
    (config.json only: the weights are not read)."""
    import shutil

    from qwen35_trainer.plan import plan

    path, rows = checkpoint
    shapes_only = tmp_path / "config_only"
    shutil.copytree(path, shapes_only, ignore=shutil.ignore_patterns("*.safetensors*"))
    recipe = _recipe(shapes_only, rows, tmp_path)
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(path)
    assert plan(recipe).total_parameters == sum(p.numel() for p in hf.parameters())
