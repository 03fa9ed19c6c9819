"""Where a run's outputs go, as the README says: checkpoints in the default run folder, the
export written at the end of a run in the format asked for, naming the base as the recipe
wrote it; ``export`` and ``data check`` read recipes whose training-only settings they do not
use."""

from __future__ import annotations

import json

from fp8_fixtures import export_base
from helpers import ONE_PROCESS, SYNTHETIC, TINY
from safetensors.torch import load_file

from qwen35_trainer.cli import main
from qwen35_trainer.demo.dataset import make_demo

LORA = "model.lora={rank: 4, alpha: 8}"


def _sets(*items):
    return [a for item in (*ONE_PROCESS, *SYNTHETIC, *items) for a in ("--set", item)]


def test_checkpoints_go_to_the_default_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["tiny", *_sets("train.steps=2", "train.checkpoint_every=1")]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


def test_the_end_of_run_export_takes_its_format_and_names_the_base_as_written(
    tmp_path, monkeypatch
):
    """A recipe file beside its base (``model.path: base``, relative): a LoRA run's
    ``train.export_dir`` in ``per_expert`` format names ``base`` as written; ``export`` of its
    checkpoint names ``--base`` when given; ``merged`` writes weights. ``export`` and ``data
    check`` read the recipe although it sets ``train.checkpoint_every`` without an output folder
    (they do not save)."""
    export_base(tmp_path / "base")
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(f"base: {TINY}\nmodel:\n  path: base\n  mtp_layers: 0\n")
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt"
    run = ("train.steps=1", LORA, f"train.checkpoint_dir={ckpt}", "train.export_dir=adapter",
           "train.export_format=per_expert")  # fmt: skip
    assert main([str(recipe), *_sets(*run)]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "base"
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert any(".experts.0.down_proj.lora_A" in k for k in keys)  # the per-expert layout
    later = (LORA, "train.checkpoint_every=5")  # training-only: export does not refuse it
    assert (
        main(["export", str(recipe), *_sets(*later), str(ckpt), "peft", "--base", "org/model"]) == 0
    )
    assert (
        json.loads((tmp_path / "peft" / "adapter_config.json").read_text())[
            "base_model_name_or_path"
        ]
        == "org/model"
    )
    assert (
        main(["export", str(recipe), *_sets(*later), str(ckpt), "merged", "--lora", "merged"]) == 0
    )
    assert (tmp_path / "merged" / "model.safetensors.index.json").is_file()
    demo = make_demo(tmp_path / "demo", train_rows=4, heldout_rows=1)
    rows = (f"data.path={demo}/train.jsonl", f"data.processor={demo}/processor",
            "data.pack_length=256")  # fmt: skip
    assert main(["data", "check", str(recipe), *_sets(*later, *rows)]) == 0
