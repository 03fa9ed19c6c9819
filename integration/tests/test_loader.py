"""The dataset loader: the data ranks' rows partition the global step (the same rows under any
data parallelism), nothing depends on the number of workers, a resumed stream continues with
exactly the uninterrupted stream's rows (and a resumed run with its losses), and documents over
capacity or bad rows are handled by their policy and counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import demo_recipe

from qwen35_trainer import train
from qwen35_trainer.data.conversation import DataError
from qwen35_trainer.data.loader import DataStream
from qwen35_trainer.demo.dataset import make_demo
from qwen35_trainer.model import build_config
from qwen35_trainer.parallel import Layout


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return make_demo(tmp_path_factory.mktemp("demo"), train_rows=40, heldout_rows=8)


def _stream(recipe, rank: int = 0, dp: int = 1) -> DataStream:
    return DataStream(
        recipe,
        build_config(recipe.model),
        Layout(data_group=rank, data_groups=dp),
        torch.device("cpu"),
    )


def _steps(stream: DataStream, n: int) -> list[list[list[str]]]:
    """The documents (``file:row``) of each row of ``n`` steps."""
    return [[[d.source for d in row] for row in stream.next_step().rows] for _ in range(n)]


def test_data_ranks_partition_the_step_and_workers_change_nothing(demo):
    recipe = demo_recipe(demo, "data.global_batch=4", "data.pack_length=160")
    whole = _steps(_stream(recipe), 4)
    ranks = [_steps(_stream(recipe, k, 2), 4) for k in range(2)]
    for step, (first, second) in enumerate(zip(*ranks, strict=True)):
        assert first + second == whole[step]  # rank k holds rows 2k, 2k + 1 of the global step
    seen = [d for step in whole[:2] for row in step for d in row]
    assert len(seen) == len(set(seen)) < 40  # within the first epoch no document repeats
    assert (
        _steps(
            _stream(
                demo_recipe(demo, "data.global_batch=4", "data.pack_length=160", "data.workers=2")
            ),
            4,
        )
        == whole
    )
    in_order = _steps(
        _stream(
            demo_recipe(demo, "data.global_batch=2", "data.pack_length=160", "data.shuffle=false")
        ),
        2,
    )
    lines = [int(d.rsplit(":", 1)[1]) for d in in_order[0][0]]  # JSONL rows: FILE:LINE
    assert lines == list(range(1, 2 * len(lines), 2))  # shard 0: positions 0, 2, 4, ...


def test_resumed_stream_continues_exactly(demo):
    recipe = demo_recipe(demo, "data.global_batch=2", "data.pack_length=128")
    through = _stream(recipe)
    expected = [through.next_step() for _ in range(4)]
    first = _stream(recipe)
    for _ in range(2):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint stores it
    again = _stream(recipe)
    again.load_state_dict({"shards": state["shards"], "cursors": list(state["cursors"].values())})
    for want in expected[2:]:
        got = again.next_step()
        for row_got, row_want in zip(got.rows, want.rows, strict=True):
            assert [d.source for d in row_got] == [d.source for d in row_want]
            for a, b in zip(row_got, row_want, strict=True):
                assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
                assert torch.equal(a.pixel_values, b.pixel_values)
    with pytest.raises(ValueError, match=r"resume with the same data\.global_batch"):
        _stream(demo_recipe(demo, "data.global_batch=4", "data.pack_length=128")).load_state_dict(
            state
        )


def test_resumed_run_has_the_uninterrupted_losses(demo, tmp_path):
    sets = (
        "data.global_batch=2",
        "data.pack_length=128",
        "train.steps=4",
        "train.eval_every=0",
        "model.expert_backend=torch",
    )
    through = train(demo_recipe(demo, *sets)).logs
    stopped = train(demo_recipe(demo, *sets, "train.steps=2", f"train.checkpoint_dir={tmp_path}"))
    assert (tmp_path / "step_000002" / "data_state.json").is_file()
    resumed = train(demo_recipe(demo, *sets, f"train.checkpoint_dir={tmp_path}")).logs
    assert [log.step for log in stopped.logs + resumed] == [1, 2, 3, 4]
    for ours, ref in zip(stopped.logs + resumed, through, strict=True):
        assert ours.tokens == ref.tokens and ours.fill == ref.fill
        assert abs(ours.loss - ref.loss) <= 1e-5 * (1 + abs(ref.loss)), (ours, ref)


def test_over_capacity_policies_are_counted(demo):
    # the demo's image and video documents are 34..78 tokens: at 48 some are over capacity
    truncated = _stream(demo_recipe(demo, "data.global_batch=2", "data.pack_length=48"))
    dropped = _stream(
        demo_recipe(demo, "data.global_batch=2", "data.pack_length=48", "data.over_capacity=drop")
    )
    t = [truncated.next_step() for _ in range(6)]
    d = [dropped.next_step() for _ in range(6)]
    assert sum(s.truncated for s in t) > 0 and sum(s.dropped for s in t) >= 0
    assert sum(s.dropped for s in d) > 0 and sum(s.truncated for s in d) == 0
    for step in t + d:
        assert all(sum(len(doc) for doc in row) <= 48 for row in step.rows)
        assert 0 < step.fill <= 1


def test_bad_rows_raise_or_are_skipped_and_counted(demo, tmp_path):
    rows = (demo / "train.jsonl").read_text().splitlines()
    bad = json.loads(rows[1])
    bad["messages"][0]["content"] = [{"type": "image", "path": "images/missing.png"}]
    rows[1] = json.dumps(bad)
    (demo / "bad.jsonl").write_text("\n".join(rows) + "\n")
    sets = (
        f"data.path={demo}/bad.jsonl",
        "data.global_batch=2",
        "data.pack_length=128",
        "data.shuffle=false",
    )
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing media file .*images/missing.png"):
        _stream(demo_recipe(demo, *sets)).next_step()
    skipping = _stream(demo_recipe(demo, *sets, "data.on_bad_row=skip"))
    steps = [skipping.next_step() for _ in range(3)]
    assert sum(s.skipped for s in steps) == 1
    assert f"{demo}/bad.jsonl:2" not in {d.source for s in steps for row in s.rows for d in row}


def test_a_user_iterable_source(demo):
    recipe = demo_recipe(
        demo,
        "data.path=null",
        "data.source=data_source:rows",
        "data.global_batch=2",
        "data.pack_length=64",
    )
    steps = _steps(_stream(recipe), 3)
    shard0 = [int(d.rsplit(":", 1)[1]) for step in steps for d in step[0]]
    assert shard0 == list(range(0, 2 * len(shard0), 2))  # positions 0, 2, 4, … of the iterable
    with pytest.raises(ValueError, match=r"data\.source must be .package\.module:callable."):
        _steps(
            _stream(
                demo_recipe(demo, "data.path=null", "data.source=nocolon", "data.pack_length=64")
            ),
            1,
        )


def test_parquet_files_and_dataset_folders_read_the_same_rows(demo, tmp_path):
    import datasets

    rows = datasets.load_dataset("json", data_files=str(demo / "train.jsonl"), split="train")
    rows.to_parquet(str(demo / "train.parquet"))
    folder = demo / "as_folder"
    folder.mkdir(exist_ok=True)
    (folder / "train.jsonl").write_text((demo / "train.jsonl").read_text())
    sets = ("data.global_batch=2", "data.pack_length=128", "data.shuffle=false")
    jsonl = _steps(_stream(demo_recipe(demo, *sets)), 2)
    parquet = _steps(_stream(demo_recipe(demo, *sets, f"data.path={demo}/train.parquet")), 2)
    # the same rows: parquet's "FILE row I" (0-based) is JSONL's "FILE:LINE" (1-based)
    assert [[[int(d.rsplit(" ", 1)[1]) for d in row] for row in step] for step in parquet] == [
        [[int(d.rsplit(":", 1)[1]) - 1 for d in row] for row in step] for step in jsonl
    ]
    # a folder: media paths are relative to it, so copy the rows next to the demo's media
    with pytest.raises(DataError, match="missing media file"):
        _steps(_stream(demo_recipe(demo, *sets, f"data.path={folder}")), 1)
    (tmp_path / "rows.csv").write_text("messages\n")
    with pytest.raises(DataError, match=r"rows\.csv: expected \.jsonl, \.json or \.parquet"):
        _steps(_stream(demo_recipe(demo, *sets, f"data.path={tmp_path}/rows.csv")), 1)
    with pytest.raises(DataError, match=r"data file .*nope\.jsonl does not exist"):
        _steps(_stream(demo_recipe(demo, *sets, f"data.path={tmp_path}/nope.jsonl")), 1)


def test_frame_sampling_follows_the_recipe(demo):
    """``data.max_frames`` / ``data.video_fps`` override the processor's sampling: the demo's
    4-frame videos (2 temporal patches) become 2 frames (1 patch)."""

    def videos(*sets):
        stream = _stream(demo_recipe(demo, "data.global_batch=2", "data.pack_length=256", *sets))
        return {
            tuple(g)
            for _ in range(3)
            for row in stream.next_step().rows
            for d in row
            for g in d.video_grid_thw.tolist()
        }

    assert videos() == {(2, 8, 8)}
    assert videos("data.max_frames=2") == {(1, 8, 8)}
    assert videos("data.video_fps=1") == {(1, 8, 8)}


def test_rows_must_split_evenly_into_micro_batches(demo):
    recipe = demo_recipe(
        demo,
        "data.global_batch=2",
        "data.pack_length=128",
        "train.grad_accum_steps=3",
        "train.steps=1",
    )
    with pytest.raises(
        ValueError,
        match=r"packed rows per rank \(data\.global_batch / data-par"
        r"allel ranks\)=2 must be a multiple of train\.grad_acc"
        r"um_steps=3",
    ):
        train(recipe)
