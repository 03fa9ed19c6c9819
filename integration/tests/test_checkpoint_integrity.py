"""Checkpoints prove their integrity: the manifest records every file's size and checksum (read
back here independently); each kind of damage is named with its file, a resumed run falls back
to the newest intact checkpoint and continues exactly; ``qwen35-train checkpoint verify``."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import xxhash
from helpers import ONE_PROCESS, TINY

from qwen35_trainer import load_recipe, train
from qwen35_trainer.cli import main
from qwen35_trainer.train.integrity import DAMAGED, INTACT, MANIFEST, NO_MANIFEST, verify
from qwen35_trainer.train.resume import DamagedCheckpointError, load_checkpoint, newest_loadable

SHARD = "__0_0.distcp"


def _demo(*overrides: str):
    """The tiny recipe in one process on its built-in demo dataset (so checkpoints carry the
    loader's data_state.json)."""
    return load_recipe(TINY, [*ONE_PROCESS, "train.eval_every=0", *overrides])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-step run with checkpoints after steps 2 and 4, and its step logs."""
    root = tmp_path_factory.mktemp("saved")
    run = train(_demo("train.steps=4", "train.checkpoint_every=2", f"train.checkpoint_dir={root}"))
    return root, run.logs


def _copy(saved, tmp_path):
    shutil.copytree(saved[0], tmp_path / "ck")
    return tmp_path / "ck"


def _truncate(path):
    with open(path / SHARD, "r+b") as f:
        f.truncate(100)


def _flip(path, name=SHARD):
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / name).write_bytes(bytes(data))


DAMAGES = {
    "truncated shard": (_truncate, rf"{SHARD}: expected \d+ bytes, found 100"),
    "flipped byte": (_flip, rf"{SHARD}: checksum [0-9a-f]+, expected [0-9a-f]+ \(xxh3_64 of"),
    "missing metadata": (lambda p: (p / ".metadata").unlink(), r"\.metadata: missing \(expected"),
    "missing data state": (
        lambda p: (p / "data_state.json").unlink(),
        r"data_state.json: missing \(expected",
    ),
}


def test_the_manifest_lists_every_file_with_its_size_and_checksum(saved):
    for step in (2, 4):
        path = saved[0] / f"step_{step:06d}"
        files = json.loads((path / MANIFEST).read_text())["files"]
        on_disk = {p.name for p in path.iterdir()} - {MANIFEST}
        # two shard files per rank (the writer's two threads)
        shards = {SHARD, "__0_1.distcp"}
        assert set(files) == on_disk == {".metadata", *shards, "data_state.json", "recipe.yaml"}
        for name, record in files.items():
            data = (path / name).read_bytes()  # the checksum was computed while writing
            assert record == {"size": len(data), "checksum": xxhash.xxh3_64(data).hexdigest()}
        assert verify(path).state == INTACT


@pytest.mark.parametrize("damage", DAMAGES)
def test_damage_is_named_and_resume_falls_back_to_the_intact_checkpoint(
    saved, tmp_path, caplog, damage
):
    ck = _copy(saved, tmp_path)
    spoil, named = DAMAGES[damage]
    spoil(ck / "step_000004")
    verdict = verify(ck / "step_000004")
    assert verdict.state == DAMAGED
    assert any(re.search(named, p) for p in verdict.problems), verdict.problems
    with caplog.at_level("INFO", logger="qwen35_trainer"):
        resumed = train(_demo("train.steps=4", f"train.checkpoint_dir={ck}"))
    warnings = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warnings) == 1 and f"{ck}/step_000004 is damaged" in warnings[0], warnings
    assert (
        caplog.records[[r.getMessage() for r in caplog.records].index(warnings[0])].levelname
        == "WARNING"
    )
    assert f"resumed from step 2 of {ck}" in caplog.text
    straight = saved[1][2:]  # the run that saved them, steps 3 and 4
    assert [(r.step, r.loss, r.grad_norm) for r in resumed.logs] == [
        (r.step, r.loss, r.grad_norm) for r in straight
    ]
    assert verify(ck / "step_000004").state == INTACT  # rewritten by the resumed run


def test_sizes_only_skips_the_checksums(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    _flip(ck / "step_000004")
    assert newest_loadable(ck, checksums=False) == (ck / "step_000004", [])
    path, warnings = newest_loadable(ck)
    assert path == ck / "step_000002" and len(warnings) == 1 and SHARD in warnings[0]


def test_a_damaged_explicit_checkpoint_or_no_intact_one_is_an_error(saved, tmp_path, capsys):
    ck = _copy(saved, tmp_path)
    _truncate(ck / "step_000004")
    result = train(_demo("train.steps=1"))
    with pytest.raises(DamagedCheckpointError, match=rf"step_000004 is damaged: {SHARD}: expected"):
        load_checkpoint(ck / "step_000004", result.objective, result.optimizer)
    assert main(["export", "tiny", str(ck / "step_000004"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("qwen35-train export:") == 1 and "step_000004 is damaged" in err
    _flip(ck / "step_000002", "recipe.yaml")
    with pytest.raises(DamagedCheckpointError, match=r"every checkpoint under .* is damaged"):
        train(_demo("train.steps=5", f"train.checkpoint_dir={ck}"))


def test_a_read_failure_is_not_called_another_model(saved, tmp_path):
    """A checkpoint without a manifest (written before manifests) whose shard is truncated: the
    shapes match, so the message says what failed to read."""
    ck = _copy(saved, tmp_path)
    (ck / "step_000004" / MANIFEST).unlink()
    _truncate(ck / "step_000004")
    assert verify(ck / "step_000004").state == NO_MANIFEST
    with pytest.raises(ValueError, match=r"step_000004: reading it failed \(") as caught:
        train(_demo("train.steps=5", f"train.checkpoint_dir={ck}"))
    assert "another shape" not in str(caught.value)


def test_checkpoint_verify_command(saved, tmp_path, capsys):
    ck = _copy(saved, tmp_path)
    shutil.copytree(ck / "step_000002", ck / "step_000001")
    (ck / "step_000001" / MANIFEST).unlink()  # as written before manifests existed
    shutil.copytree(ck / "step_000002", ck / "step_000006.partial")
    _truncate(ck / "step_000004")
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(ck)]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step_000001: no manifest"
    assert lines[1].startswith("step_000002: intact (5 files, ")
    assert lines[2].startswith(f"step_000004: damaged: {SHARD}: expected ")
    assert lines[3] == "step_000006.partial: incomplete: a save that did not finish"
    assert len(lines) == 4
    assert main(["checkpoint", "verify", str(ck / "step_000002")]) == 0
    assert capsys.readouterr().out.startswith("step_000002: intact")
    assert main(["checkpoint", "verify", str(tmp_path / "nothing")]) == 2
    assert "no such directory" in capsys.readouterr().err
