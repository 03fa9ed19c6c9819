"""Checkpoint and resume in one process: bit-identical continuation; what counts as complete."""

from __future__ import annotations

import torch
from helpers import tiny

from qwen35_trainer import train
from qwen35_trainer.train.integrity import INTACT, verify
from qwen35_trainer.train.resume import checkpoints_in


def test_resume_continues_bit_identically(tmp_path, caplog):
    with train(tiny("train.steps=3")) as straight:  # read before the next run releases it
        ref_state = straight.state_dict()
    first = train(tiny("train.steps=1", f"train.checkpoint_dir={tmp_path}"))
    with caplog.at_level("INFO", logger="qwen35_trainer"):
        resumed = train(tiny("train.steps=3", f"train.checkpoint_dir={tmp_path}"))
    assert f"resumed from step 1 of {tmp_path}" in caplog.text
    assert "train.steps changed on resume: 1 -> 3" in caplog.text
    assert "train.lr changed" not in caplog.text
    assert [log.step for log in first.logs] == [1]
    assert [log.step for log in resumed.logs] == [2, 3]
    for ours, ref in zip(resumed.logs, straight.logs[1:], strict=True):
        assert (ours.loss, ours.grad_norm, ours.tokens) == (ref.loss, ref.grad_norm, ref.tokens)
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, ref_state[name]), name
    assert checkpoints_in(tmp_path)[0][0] == 3
    again = train(tiny("train.steps=3", f"train.checkpoint_dir={tmp_path}"))
    assert again.logs == []  # nothing left to run


def test_only_final_names_are_checkpoints(tmp_path):
    assert checkpoints_in(tmp_path / "missing") == []
    for name in ("step_000007.partial", "step_000002", "step_000010", "notes"):
        (tmp_path / name).mkdir()
    assert checkpoints_in(tmp_path) == [
        (10, tmp_path / "step_000010"),
        (2, tmp_path / "step_000002"),
    ]


def test_a_crafted_metadata_pickle_is_refused_without_running_it(tmp_path):
    import os
    import pickle

    import pytest

    from qwen35_trainer.train.resume import UnsafeCheckpointError, load_checkpoint

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    crafted = tmp_path / "step_000001"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(pickle.dumps(Payload()))
    result = train(tiny("train.steps=1"))
    with pytest.raises(UnsafeCheckpointError, match=r"asks for posix.system, which a DCP"):
        load_checkpoint(crafted, result.objective, torch.optim.AdamW(result.objective.parameters()))
    assert not marker.exists()


def test_saves_are_atomic_and_keep_the_newest(tmp_path):
    train(
        tiny(
            "train.steps=4",
            "train.checkpoint_every=1",
            f"train.checkpoint_dir={tmp_path}",
            "train.keep_checkpoints=2",
        )
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]
    # a save that crashed after DCP wrote everything but before the rename does not count
    (tmp_path / "step_000004").rename(tmp_path / "step_000009.partial")
    assert checkpoints_in(tmp_path) == [(3, tmp_path / "step_000003")]


def test_a_checkpoint_of_another_model_is_one_clear_error(tmp_path):
    """Shapes are compared with the checkpoint's metadata before reading: the message names
    the tensors and both shapes; a layer only one side has is named too."""
    import pytest

    train(tiny("train.steps=1", f"train.checkpoint_dir={tmp_path}"))
    experts = "model.model.language_model.layers.0.mlp.experts"
    with pytest.raises(
        ValueError,
        match=r"holds a model of another shape \(8 tensor\(s\) differ"
        rf"\): {experts}.down_proj: \[8, 32, 16\] in the checkpoint, \[8, 32, 24\] "
        rf"in this model; {experts}.gate_up_proj: \[8, 32, 32\] in the",
    ):
        train(
            tiny(
                "train.steps=2",
                f"train.checkpoint_dir={tmp_path}",
                "model.text.moe_intermediate_size=24",
            )
        )
    with pytest.raises(
        ValueError,
        match=r"\(30 tensor\(s\) differ\): \S+layers\.2\.linear_attn\.A_log: in the checkpoint, not in ",
    ):
        train(
            tiny(
                "train.steps=2",
                f"train.checkpoint_dir={tmp_path}",
                "model.text.num_hidden_layers=3",
                "model.text.layer_types=[linear_attention, linear_attention, full_attention]",
            )
        )


def test_a_changed_lr_on_resume_is_applied_and_said(tmp_path, caplog):
    train(tiny("train.steps=1", f"train.checkpoint_dir={tmp_path}"))
    with caplog.at_level("INFO", logger="qwen35_trainer"):
        resumed = train(tiny("train.steps=2", "train.lr=0.5", f"train.checkpoint_dir={tmp_path}"))
    assert "train.lr changed on resume: 0.01 -> 0.5 (the new value applies)" in caplog.text
    assert "train.steps changed on resume: 1 -> 2" in caplog.text
    assert [log.lr for log in resumed.logs] == [0.5]


def test_async_checkpoints_hold_the_state_of_their_step(tmp_path):
    """train.async_checkpoint: each checkpoint is written while training goes on, yet holds
    the state after its own step (DCP stages a copy); resuming from the one after step 2
    continues exactly like the uninterrupted run."""
    import shutil

    straight = train(tiny("train.steps=4"))
    run = (
        f"train.checkpoint_dir={tmp_path}",
        "train.checkpoint_every=1",
        "train.async_checkpoint=true",
    )
    train(tiny("train.steps=4", *run))
    assert checkpoints_in(tmp_path)[0][0] == 4  # the last one completed before returning
    assert verify(tmp_path / "step_000004").state == INTACT  # its manifest was written too
    for later in ("step_000003", "step_000004"):
        shutil.rmtree(tmp_path / later)
    resumed = train(tiny("train.steps=4", *run))
    assert [log.step for log in resumed.logs] == [3, 4]
    for ours, ref in zip(resumed.logs, straight.logs[2:], strict=True):
        assert (ours.loss, ours.grad_norm) == (ref.loss, ref.grad_norm)


def test_a_checkpoint_with_param_group_lists_still_resumes(tmp_path, monkeypatch):
    """Checkpoints are keyed by parameter name (any ``pp`` reads them); one written before, with
    the optimizer's param groups as lists (``optim.param_groups.0...``), still resumes exactly."""
    import functools

    from qwen35_trainer.train import checkpoint, resume

    straight = train(tiny("train.steps=2"))
    nested = functools.partial(resume.sharded_state, options=resume.SAVED_NESTED)
    with monkeypatch.context() as patched:
        patched.setattr(checkpoint, "sharded_state", nested)
        train(tiny("train.steps=1", f"train.checkpoint_dir={tmp_path}"))
    assert resume._nested_optimizer(tmp_path / "step_000001")
    resumed = train(tiny("train.steps=2", f"train.checkpoint_dir={tmp_path}"))
    assert [(log.loss, log.grad_norm) for log in resumed.logs] == [
        (log.loss, log.grad_norm) for log in straight.logs[1:]
    ]
    assert not resume._nested_optimizer(tmp_path / "step_000002")  # written by name
