"""A run folder started more than once (a resumed run, an elastic restart) holds one record per
step for every reader: ``step_records`` keeps the last attempt's row of a step and drops what a
later attempt cut off, ``loss.png`` is drawn from those records, and TensorBoard shows each step
once (a later attempt purges the earlier events from its first step on)."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import ONE_PROCESS, SYNTHETIC, tiny

import qwen35_trainer.supervise.run_folder as run_folder
from qwen35_trainer.cli import main
from qwen35_trainer.supervise.metrics import StepLog
from qwen35_trainer.supervise.run_folder import RunFolder, step_records


def _sets(*items: str) -> list[str]:
    return [a for item in (*ONE_PROCESS, *SYNTHETIC, *items) for a in ("--set", item)]


def _write(path, *attempts: list[int], attempt_field: bool = True) -> None:
    """A ``metrics.jsonl`` whose attempt k records the steps ``attempts[k]`` (``loss`` is
    ``100 * k + step``, so a row says which attempt wrote it)."""
    lines = []
    for k, steps in enumerate(attempts):
        lines.append({"header": {"attempt": k, "kernels": {}}})
        for step in steps:
            row = StepLog(step, 100.0 * k + step, 1.0, 0.0, 1.0, 8, 0.5).metrics()
            lines.append({**row, "attempt": k} if attempt_field else row)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.parametrize("attempt_field", [True, False])
def test_the_last_attempt_wins_and_cuts_what_came_after_its_first_step(tmp_path, attempt_field):
    """Attempt 1 (an elastic restart from the checkpoint of step 6) repeats steps 7, 8 of
    attempt 0 and stops; attempt 2 failed before its first step; attempt 3 repeats 8 and goes
    on. Rows without ``attempt`` (older files) belong to the header above them."""
    path = tmp_path / "metrics.jsonl"
    _write(path, list(range(1, 11)), [7, 8], [], [8, 9, 10, 11], attempt_field=attempt_field)
    records = step_records(path)
    assert [r["step"] for r in records] == list(range(1, 12))
    assert [r["loss"] for r in records] == [*range(1, 7), 107, 308, 309, 310, 311]


def test_steps_an_earlier_attempt_took_past_a_later_attempts_end_are_dropped(tmp_path):
    """Attempt 1 resumed from step 4 and ended at step 6 (fewer ``train.steps``): attempt 0's
    steps 7..10 followed a trajectory no attempt continued."""
    path = tmp_path / "metrics.jsonl"
    _write(path, list(range(1, 11)), [5, 6])
    assert [(r["step"], r["loss"]) for r in step_records(path)] == [
        (1, 1),
        (2, 2),
        (3, 3),
        (4, 4),
        (5, 105),
        (6, 106),
    ]


def test_a_start_counts_the_earlier_ones_and_drops_a_cut_line(tmp_path):
    """A killed attempt left half a row: readers skip it, the next start removes it, writes its
    header on its own line with the attempt number (the headers before it) and tags its rows."""
    path = tmp_path / "metrics.jsonl"
    _write(path, [1, 2, 3], [3, 4])
    path.write_text(path.read_text() + '{"step": 5, "lo')
    assert [r["step"] for r in step_records(path)] == [1, 2, 3, 4]
    folder = RunFolder(tmp_path, tiny("train.trackers=[]"))
    assert folder.attempt == 2
    folder.record(StepLog(5, 1.0, 1.0, 0.0, 1.0, 8, 0.5))
    folder.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[-2] == {"header": {"attempt": 2, "kernels": {}}}
    assert lines[-1]["step"] == 5 and lines[-1]["attempt"] == 2
    assert [(r["step"], r["attempt"]) for r in step_records(path)] == [
        (1, 0),
        (2, 0),
        (3, 1),
        (4, 1),
        (5, 2),
    ]


def test_a_resumed_run_records_each_step_once(tmp_path, monkeypatch):
    """4 steps with a checkpoint every 2, the last checkpoint lost (as when a worker dies
    after logging step 4 but before saving it), then the same run to 5 steps: it resumes from
    step 2 and repeats 3 and 4. Every reader sees steps 1..5 once, 3 and 4 from attempt 1:
    ``step_records``, ``loss.png``'s data and TensorBoard (whose step times are attempt 1's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plotted = []
    drawn = run_folder.plot_loss
    monkeypatch.setattr(
        run_folder,
        "plot_loss",
        lambda records, path: (plotted.append(records), drawn(records, path)),
    )
    out = tmp_path / "run"
    common = ("train.checkpoint_every=2", "train.eval_every=2", f"train.output_dir={out}")
    assert main(["tiny", *_sets(*common, "train.steps=4")]) == 0
    shutil.rmtree(out / "checkpoints" / "step_000004")
    assert main(["tiny", *_sets(*common, "train.steps=5")]) == 0

    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "header" not in r]
    assert [(r["step"], r["attempt"]) for r in rows] == [
        *((s, 0) for s in (1, 2, 3, 4)),
        *((s, 1) for s in (3, 4, 5)),
    ]
    records = step_records(out / "metrics.jsonl")
    assert [(r["step"], r["attempt"]) for r in records] == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
    assert records[2:] == rows[4:]  # attempt 1's rows themselves
    assert [r["step"] for r in plotted[-1]] == [1, 2, 3, 4, 5]
    assert plotted[-1] == records
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5]
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4, 5]
    seconds = [e.value for e in events.Scalars("train/step_seconds")]
    assert seconds == pytest.approx([r["step_seconds"] for r in records], rel=1e-6)
