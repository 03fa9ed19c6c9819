"""Hugging Face Hub ids as ``model.path``, ``data.processor``, ``data.path`` and
``data.eval_path`` (:mod:`qwen35_trainer.recipe.hub`), resolved offline from a Hub cache each
test writes in huggingface_hub's own layout (:mod:`hub_cache`): the tiny model exported by the
trainer, the demo processor, and two dataset repositories whose README's ``configs`` give two
subsets each (the demo conversations as JSON Lines with their media; text rows in Parquet).

A run from Hub ids equals the run from the same files as local folders (every loss and the
held-out loss), and its header names each id, revision and snapshot; a local folder of the
same name wins; a pinned commit or tag resolves to its snapshot and the run folder's recipe
loads back to the same recipe; only the trainer's files are asked for (no safetensors for the
planner); no network and no cached copy, a malformed id, an unknown subset are each one error
naming the key and the fix. Not covered: a real download (no network here)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import yaml
from helpers import ONE_PROCESS, TINY, tiny
from hub_cache import cache_repo

from qwen35_trainer import build_model, load_recipe, train
from qwen35_trainer.data.rows import open_rows
from qwen35_trainer.demo.dataset import make_demo
from qwen35_trainer.model import export_hf
from qwen35_trainer.recipe import recipe_from_dict
from qwen35_trainer.recipe.hub import LIGHT_FILES, MODEL_FILES
from qwen35_trainer.supervise.console import input_lines

MODEL, PROCESSOR = "test-org/tiny-qwen35", "test-org/demo-processor"
DATA, TEXT = "test-org/demo-data", "test-org/text-rows"
TEXT_ROWS = {
    "text": [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "user", "content": "one?"}, {"role": "assistant", "content": "1"}]},
    ],
    "other": [
        {"messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]}
    ],
}
# datasets takes one builder for a repository (its first subset's format): one JSON, one Parquet
DATA_README = """---
configs:
- config_name: conversations
  data_files:
  - split: train
    path: conversations/train.jsonl
  - split: test
    path: conversations/test.jsonl
- config_name: first
  data_files: conversations/first.jsonl
---
The demo conversations (and the first of them alone).
"""
TEXT_README = """---
configs:
- config_name: text
  data_files:
  - split: train
    path: text/train-*.parquet
- config_name: other
  data_files: other/*.parquet
---
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Local folders: the tiny model (exported by the trainer), the demo dataset and its
    processor, and the dataset repository's files."""
    import datasets

    root = tmp_path_factory.mktemp("hub-sources")
    demo = make_demo(root / "demo", train_rows=4, heldout_rows=1)
    export_hf(build_model(tiny().model), root / "model")
    data, text = root / "data-repo", root / "text-repo"
    shutil.copytree(demo, data / "conversations", ignore=shutil.ignore_patterns("processor"))
    (data / "conversations" / "heldout.jsonl").rename(data / "conversations" / "test.jsonl")
    first = (demo / "train.jsonl").read_text().splitlines()[0]
    (data / "conversations" / "first.jsonl").write_text(first + "\n")
    (data / "README.md").write_text(DATA_README)
    for subset, rows in TEXT_ROWS.items():
        (text / subset).mkdir(parents=True)
        datasets.Dataset.from_list(rows).to_parquet(text / subset / "train-00000.parquet")
    (text / "README.md").write_text(TEXT_README)
    return {"model": root / "model", "demo": demo, "data": data, "text": text}


@pytest.fixture
def hub(sources, tmp_path, monkeypatch):
    """The sources as Hub repositories in a fresh cache (``HF_HUB_CACHE``), the Hub off
    (``HF_HUB_OFFLINE=1``; huggingface_hub reads both at import, so its constants are set too),
    the working directory an empty folder; each repository's commit and the cache."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    commits = {
        MODEL: cache_repo(cache, MODEL, sources["model"], refs=("main", "v1")),
        PROCESSOR: cache_repo(cache, PROCESSOR, sources["demo"] / "processor"),
        DATA: cache_repo(cache, DATA, sources["data"], kind="dataset"),
        TEXT: cache_repo(cache, TEXT, sources["text"], kind="dataset"),
    }
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return commits, cache


def _recipe(*overrides: str):
    return load_recipe(
        TINY,
        [
            *ONE_PROCESS,
            "train.steps=2",
            "train.eval_every=2",
            "train.eval_steps=1",
            "data.eval_split=test",
            *overrides,
        ],
    )


def _snapshot(cache, kind: str, repo: str, commit: str) -> str:
    return str(cache / f"{kind}s--{repo.replace('/', '--')}" / "snapshots" / commit)


def test_a_run_from_hub_ids_equals_the_run_from_local_folders(hub, sources, tmp_path):
    commits, cache = hub
    model = _snapshot(cache, "model", MODEL, commits[MODEL])
    data = _snapshot(cache, "dataset", DATA, commits[DATA])
    from_hub = _recipe(
        f"model.path={MODEL}",
        f"data.processor={PROCESSOR}",
        f"data.path={DATA}",
        f"data.eval_path={DATA}",
        "data.subset=conversations",
        f"train.output_dir={tmp_path / 'run'}",
    )
    assert from_hub.model.path == model
    assert from_hub.model.from_hub == {"path": f"{MODEL}@main"}
    assert from_hub.data.from_hub == {
        "processor": f"{PROCESSOR}@main",
        "path": f"{DATA}@main",
        "eval_path": f"{DATA}@main",
    }
    local = _recipe(
        f"model.path={sources['model']}",
        f"data.processor={sources['demo'] / 'processor'}",
        f"data.path={sources['demo'] / 'train.jsonl'}",
        f"data.eval_path={sources['demo'] / 'heldout.jsonl'}",
    )
    hub_logs, local_logs = train(from_hub).logs, train(local).logs
    said = [(log.loss, log.eval_loss) for log in hub_logs]
    assert said == [(log.loss, log.eval_loss) for log in local_logs]
    assert len(said) == 2 and said[-1][1] is not None and said[0][1] is None
    assert torch.isfinite(torch.tensor([said[0][0], *said[1]])).all()
    header = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    processor = _snapshot(cache, "model", PROCESSOR, commits[PROCESSOR])
    assert f"model.path: Hub model {MODEL}@main, snapshot {model}\n" in header
    assert f"data.processor: Hub model {PROCESSOR}@main, snapshot {processor}\n" in header
    assert f"data.path: Hub dataset {DATA}@main, snapshot {data}\n" in header
    assert f"data: {DATA}@main through {PROCESSOR}@main, packed to 256" in header
    assert input_lines(local)[0] == f"model.path: local {sources['model']}"
    saved = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())
    assert recipe_from_dict(saved) == from_hub  # the snapshot, a local path now, wins


def test_a_local_folder_of_the_same_name_wins(hub, sources, tmp_path):
    assert _recipe(f"model.path={MODEL}").model.from_hub == {"path": f"{MODEL}@main"}
    shutil.copytree(sources["model"], tmp_path / "work" / MODEL)  # ./test-org/tiny-qwen35
    recipe = _recipe(f"model.path={MODEL}", "model.revision=v1")
    assert recipe.model.path == str(tmp_path / "work" / MODEL) and recipe.model.from_hub == {}
    assert recipe.model.base_as_written == MODEL
    # a data file's name is a local path (missing here), never a Hub id
    assert _recipe("data.path=data/t.jsonl").data.path == str(tmp_path / "work" / "data/t.jsonl")
    assert input_lines(recipe)[0] == f"model.path: local {tmp_path / 'work' / MODEL}"
    # relative to the recipe file that names it, as every relative path
    (tmp_path / "recipes" / "test-org").mkdir(parents=True)
    shutil.copytree(sources["demo"] / "processor", tmp_path / "recipes" / PROCESSOR)
    file = tmp_path / "recipes" / "r.yaml"
    file.write_text(yaml.safe_dump({"base": str(TINY), "data": {"processor": PROCESSOR}}))
    recipe = load_recipe(file, ONE_PROCESS)
    assert recipe.data.processor == str(tmp_path / "recipes" / PROCESSOR)
    assert recipe.data.from_hub == {}
    # a recipe mapping's relative path is the working directory's
    assert recipe_from_dict({"model": {"path": MODEL}}).model.path == MODEL  # ./test-org/...


def test_a_pinned_revision_resolves_to_its_snapshot(hub):
    commits, cache = hub
    for revision in (commits[MODEL], "v1"):
        recipe = _recipe(f"model.path={MODEL}", f"model.revision={revision}", "data.processor=null")
        assert recipe.model.path == _snapshot(cache, "model", MODEL, commits[MODEL])
        assert recipe.model.from_hub == {"path": f"{MODEL}@{revision}"}
        # data.processor defaults to model.path: the same snapshot
        assert recipe.data.processor == recipe.model.path
    with pytest.raises(ValueError, match=rf"model.path: .*{MODEL}@v2 cannot be fetched"):
        _recipe(f"model.path={MODEL}", "model.revision=v2")
    # data.eval_path names data.path's repository: read at data.revision, with data.subset
    recipe = _recipe(
        f"data.path={DATA}",
        f"data.eval_path={DATA}",
        f"data.revision={commits[DATA]}",
        "data.subset=conversations",
    )
    assert recipe.data.from_hub["eval_path"] == f"{DATA}@{commits[DATA]}"
    assert recipe.data.subset_of(True) == "conversations"


def test_only_the_trainers_files_are_asked_for(hub, monkeypatch):
    import huggingface_hub

    asked, fetch = [], huggingface_hub.snapshot_download

    def spy(repo_id, **kwargs):
        asked.append((repo_id, kwargs["repo_type"], kwargs["allow_patterns"]))
        return fetch(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    _recipe(f"model.path={MODEL}", f"data.path={TEXT}", "data.subset=text")
    load_recipe(TINY, [*ONE_PROCESS, f"model.path={MODEL}", "model.revision=v1"], hub_weights=False)
    assert asked == [
        (MODEL, "model", list(MODEL_FILES)),
        (TEXT, "dataset", ["README.md"]),
        (TEXT, "dataset", ["README.md", "text/train-*.parquet"]),
        (MODEL, "model", list(LIGHT_FILES)),  # the planner's: no safetensors
    ]
    assert not any(p.endswith("safetensors") for p in LIGHT_FILES)


def test_a_hub_dataset_subset_reads_as_datasets_gives_it(hub, sources):
    for subset, rows in TEXT_ROWS.items():  # Parquet: datasets.load_dataset(snapshot, subset)
        recipe = _recipe(f"data.path={TEXT}", f"data.subset={subset}")
        read = open_rows(recipe.data.path, "train", recipe.data.subset)
        assert [read.row(i) for i in range(len(read))] == rows
    recipe = _recipe(f"data.path={DATA}", "data.subset=first")  # JSON Lines, file by file
    train_rows = open_rows(str(sources["demo"] / "train.jsonl"))
    for subset, split, rows in (("first", "train", 1), ("conversations", "train", 4)):
        read = open_rows(recipe.data.path, split, subset)
        assert [read.row(i) for i in range(len(read))] == [train_rows.row(i) for i in range(rows)]
    with pytest.raises(ValueError, match=r"data.path: the dataset has no subset 'pictures'.*"):
        _recipe(f"data.path={DATA}", "data.subset=pictures")


def test_without_the_hub_or_a_cached_copy_one_error_names_the_fixes(hub, monkeypatch):
    from huggingface_hub import constants

    _, cache = hub
    offline = (
        rf"data.processor: 'test-org/absent' is no local path, and the Hub model "
        rf"test-org/absent@main cannot be fetched: HF_HUB_OFFLINE is set and the Hub cache "
        rf"{re.escape(str(cache))} holds no copy\. Fix: connect to the network and unset HF_HUB_OFFLINE; or "
        r"download it once where there is a network \(`hf download test-org/absent --revision "
        r"main`.*; or set data.processor to a local folder"
    )
    with pytest.raises(ValueError, match=offline):
        _recipe("data.processor=test-org/absent")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ValueError, match=r"data.path: .* the Hub cannot be reached .*--repo-type"):
        _recipe("data.path=test-org/absent-data", "data.revision=v3")
    with pytest.raises(ValueError, match=r"data.processor: 'test-org/bad name' is no local path"):
        _recipe("data.processor=test-org/bad name")
    with pytest.raises(ValueError, match=r"model.path: 'a/b\.' is no local path and not a Hub"):
        recipe_from_dict({"model": {"path": "a/b."}})
