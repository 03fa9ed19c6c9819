"""Checkpoint and resume in one process: bit-identical continuation; what counts as complete."""

from __future__ import annotations

import torch
from helpers import tiny

from qwen35_trainer import train
from qwen35_trainer.checkpoint import latest_checkpoint


def test_resume_continues_bit_identically(tmp_path, caplog):
    straight = train(tiny("train.steps=3"))
    first = train(tiny("train.steps=1", f"train.checkpoint_dir={tmp_path}"))
    with caplog.at_level("INFO", logger="qwen35_trainer"):
        resumed = train(tiny("train.steps=3", f"train.checkpoint_dir={tmp_path}"))
    assert f"resumed from step 1 of {tmp_path}" in caplog.text
    assert [log.step for log in first.logs] == [1]
    assert [log.step for log in resumed.logs] == [2, 3]
    for ours, ref in zip(resumed.logs, straight.logs[1:], strict=True):
        assert (ours.loss, ours.grad_norm, ours.tokens) == (ref.loss, ref.grad_norm, ref.tokens)
    ref_state = straight.objective.state_dict()
    for name, value in resumed.objective.state_dict().items():
        assert torch.equal(value, ref_state[name]), name
    assert latest_checkpoint(tmp_path)[1] == 3
    again = train(tiny("train.steps=3", f"train.checkpoint_dir={tmp_path}"))
    assert again.logs == []  # nothing left to run


def test_only_complete_checkpoints_count(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    (tmp_path / "step_000007").mkdir()  # no .metadata: an interrupted save
    (tmp_path / "step_000002").mkdir()
    (tmp_path / "step_000002" / ".metadata").write_bytes(b"")
    (tmp_path / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == (tmp_path / "step_000002", 2)
