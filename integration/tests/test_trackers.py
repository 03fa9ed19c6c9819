"""``train.trackers``: W&B (offline) and MLflow (a local file store) get the scalars of
``metrics.jsonl`` at its steps and the resolved recipe as the run's config, and a resumed run
continues the same tracked run; an unknown tracker and a missing extra are refused with one
message. No network: W&B's offline files and MLflow's store are read back from disk."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
from pathlib import Path

import pytest
import yaml
from helpers import ONE_PROCESS, SYNTHETIC, TINY, tiny

from qwen35_trainer.cli import main
from qwen35_trainer.recipe import load_recipe
from qwen35_trainer.supervise.metrics import METRIC_FIELDS
from qwen35_trainer.supervise.run_folder import RunFolder, step_records
from qwen35_trainer.supervise.trackers import flat_params, require_trackers, scalars


def _sets(*items: str) -> list[str]:
    return [a for item in (*ONE_PROCESS, *SYNTHETIC, *items) for a in ("--set", item)]


def _wandb_records(path):
    """The records of an offline W&B run file (``run-<id>.wandb``): a 7-byte file header
    (``:W&B``, magic, version), then 32 KiB blocks of chunks, each a 7-byte header (checksum,
    length, kind: 1 whole, 2 first, 3 middle, 4 last) and a piece of a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _wandb_run(path):
    """``(run id, {step: {key: value}}, config)`` of one offline run file."""
    run_id, history, config = None, {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            updates = record.run.config.update
        elif kind == "config":
            updates = record.config.update
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            step = row.pop("_step")
            assert step not in history, f"step {step} logged twice"
            history[step] = {k: v for k, v in row.items() if not k.startswith("_")}
            continue
        else:
            continue
        config.update({_key(u): json.loads(u.value_json) for u in updates})
    config.pop("_wandb", None)
    return run_id, history, config


def test_wandb_and_mlflow_follow_the_run_folder_across_a_resume(tmp_path, monkeypatch):
    """2 steps with a checkpoint after each, the second checkpoint lost, then the run to 3
    steps: it resumes from step 1 and repeats step 2. One W&B run and one MLflow run, ids in
    ``trackers.json``, hold steps 1..3 once each with the scalars of their first row in
    ``metrics.jsonl`` (a tracked run keeps a step's first value); the config is the recipe of
    ``recipe.yaml`` (MLflow's params keep the first start's ``train.steps``)."""
    from mlflow.tracking import MlflowClient

    store = f"file:{tmp_path / 'mlruns'}"
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": store,
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    common = (
        "train.trackers=[wandb, mlflow]",
        "train.checkpoint_every=1",
        "train.eval_every=2",
        f"train.output_dir={out}",
    )
    assert main(["tiny", *_sets(*common, "train.steps=2")]) == 0
    ids = json.loads((out / "trackers.json").read_text())
    shutil.rmtree(out / "checkpoints" / "step_000002")
    assert main(["tiny", *_sets(*common, "train.steps=3")]) == 0
    assert json.loads((out / "trackers.json").read_text()) == ids
    assert not (out / "tensorboard").exists()  # not among the trackers

    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "header" not in r]
    assert [(r["step"], r["attempt"]) for r in rows] == [(1, 0), (2, 0), (2, 1), (3, 1)]
    assert all(set(r) == set(METRIC_FIELDS) for r in rows)
    first = {}
    for row in rows:
        first.setdefault(row["step"], row)
    expected = {step: scalars(row) for step, row in first.items()}
    assert {"train/loss", "train/grad_norm", "eval/loss"} <= set(expected[2])
    # a resume is exact: the tracked losses are also the run's (step_records: the last rows)
    assert [first[r["step"]]["loss"] for r in step_records(out / "metrics.jsonl")] == [
        r["loss"] for r in step_records(out / "metrics.jsonl")
    ]
    recipe_text = (out / "recipe.yaml").read_text()
    recipe = yaml.safe_load(recipe_text)
    assert recipe["train"]["steps"] == 3

    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2, files  # one per start, both of the same run
    runs = [_wandb_run(f) for f in files]
    assert [run_id for run_id, _, _ in runs] == [ids["wandb"]] * 2
    history = {**runs[0][1], **runs[1][1]}
    assert sorted(runs[0][1]) == [1, 2] and sorted(runs[1][1]) == [3]
    assert sorted(history) == sorted(expected)
    for step, values in expected.items():
        assert history[step] == pytest.approx(values), step
    assert runs[1][2] == recipe
    assert runs[0][2]["train"]["steps"] == 2

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    for key in set().union(*expected.values()):
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert len(client.get_metric_history(run.info.run_id, key)) == len(logged), key
        assert logged == pytest.approx({s: v[key] for s, v in expected.items() if key in v}), key
    params = flat_params(recipe)
    assert params["train.steps"] == "3" and run.data.params["train.steps"] == "2"
    assert run.data.params == {**params, "train.steps": "2"}
    artifact = client.download_artifacts(run.info.run_id, "recipe.yaml", str(tmp_path))
    assert Path(artifact).read_text() == recipe_text
    assert "keeps the first start's params ['train.steps']" in (out / "logs/rank0.log").read_text()


def test_an_unknown_tracker_is_refused_by_name():
    with pytest.raises(ValueError, match=r"train.trackers must be a list of distinct names") as e:
        load_recipe(TINY, ["train.trackers=[tensorboard, neptune]"])
    assert "['tensorboard', 'wandb', 'mlflow']" in str(e.value) and "neptune" in str(e.value)
    with pytest.raises(ValueError, match=r"train.trackers must be"):
        load_recipe(TINY, ["train.trackers=[wandb, wandb]"])
    assert load_recipe(TINY).train.trackers == ("tensorboard",)


def test_a_missing_extra_is_named(tmp_path, monkeypatch):
    """Without wandb installed, the run folder (every rank) refuses before any step, naming
    the extra that brings it."""
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else found(name, *a)
    )
    with pytest.raises(ValueError, match=r"pip install 'qwen35-trainer\[wandb\]'"):
        RunFolder(tmp_path, tiny("train.trackers=[tensorboard, wandb]"), rank=1)
    require_trackers(("tensorboard", "mlflow"))
