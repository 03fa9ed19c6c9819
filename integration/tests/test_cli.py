"""``qwen35-train``: the README's main command (the built-in tiny recipe on 4 local workers it
starts itself, CP 2 × EP 2) leaves a complete run folder and learns; bad input gets one message
and its exit code; a real torchrun launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml
from helpers import ONE_PROCESS, SYNTHETIC

import qwen35_trainer.cli as cli
from qwen35_trainer import load_recipe
from qwen35_trainer.cli import main
from qwen35_trainer.recipe import recipe_from_dict
from qwen35_trainer.supervise.metrics import METRIC_FIELDS
from qwen35_trainer.supervise.run_folder import step_records

LINE = re.compile(r"^step +(\d+)/(\d+)  loss ([0-9.]+)  ce ([0-9.]+)  aux ([0-9.]+)  ")


def _losses(text: str) -> list[float]:
    return [float(m.group(3)) for m in map(LINE.match, text.splitlines()) if m]


def test_main_command_trains_on_4_workers_and_fills_the_run_folder(capfd, tmp_path):
    """``qwen35-train tiny``, shortened to 30 steps: 4 workers (DP 2 × CP 2, EP 2) started by
    the command itself; rank 0 alone prints, first what runs (layout, precision, kernels,
    parameters, where each input was read from, data, run folder), and no warning; the loss falls; the run folder has the
    resolved recipe, every metric of every step, TensorBoard events, the plot and 4 rank
    logs."""
    out_dir = tmp_path / "run"
    args = ["train.steps=30", "train.eval_every=10", f"train.output_dir={out_dir}"]
    assert main(["tiny", *(a for item in args for a in ("--set", item))]) == 0
    out, err = capfd.readouterr()
    said = [line.removeprefix("qwen35-train: ") for line in err.splitlines()]
    assert said[0] == "starting 4 local workers: dp 2 x cp 2 (--nproc N changes dp)", err
    opening = [
        line.split(":")[0]
        for line in said[2 : said.index(next(x for x in said if x.startswith("run folder"))) + 1]
    ]
    inputs = ["data.processor", "data.path", "data.eval_path"]  # where each was read from
    assert opening == [
        "layout",
        "precision",
        "kernels",
        "parameters",
        *inputs,
        "data",
        "run folder",
    ], err
    assert said[2].startswith("layout: pp 1 x dp_replicate 1 x dp 2 x cp 2 x tp 1, ep 2"), err
    for noise in ("returned a view tensor", "CUDA_HOME", "sequential all_reduce", "Warning"):
        assert noise not in err, err  # nothing a user would read as "my run may be wrong"
    losses = _losses(out)
    assert len(losses) == 30, out  # one line per step: only rank 0 prints
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert "tok/s (warm-up)" in out.splitlines()[0] and "warm-up" not in out.splitlines()[1]
    assert out.strip().splitlines()[-1].startswith("done: steps 1..30 of 30")
    assert "tok/s after the first step" in out.strip().splitlines()[-1]
    resolved = recipe_from_dict(yaml.safe_load((out_dir / "recipe.yaml").read_text()))
    assert resolved == load_recipe("tiny", args)
    records = step_records(out_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(set(r) == set(METRIC_FIELDS) for r in records)
    assert [round(r["loss"], 4) for r in records] == losses
    assert all(r["cp_imbalance"] >= 1.0 and r["tokens_per_s"] > 0 for r in records)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    assert len(events.Scalars("train/loss")) == 30
    assert [e.step for e in events.Scalars("eval/loss")] == [10, 20, 30]
    assert [r["step"] for r in records if r["eval_loss"] is not None] == [10, 20, 30]
    assert (out_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (out_dir / "logs").iterdir()) == [
        f"rank{r}.log" for r in range(4)
    ]


def test_bad_recipes_exit_2_with_one_message(capsys, tmp_path):
    cases = [
        (["tiny", "--set", "train.stepz=1"], "unknown recipe key(s) ['train.stepz']"),
        ([str(tmp_path / "missing.yaml")], "no recipe file"),
        (["tiny", "--set", "train.grad_clip=-1"], "train.grad_clip must be > 0, or null"),
        (["tiny", "--set", "train.log_every=0"], "train.log_every must be >= 1, got 0"),
        (["tiny", "--set", "train.steps=0"], "train.steps must be >= 1, got 0"),
        (
            ["tiny", "--nproc", "3"],
            "--nproc 3 is not a multiple of parallel.pp x dp_replicate x cp",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("qwen35-train:") == 1 and message in err, (argv, err)
        assert "Traceback" not in err


def test_layouts_that_do_not_fit_the_launch_are_refused(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")  # as if launched: no workers are started
    assert main(["tiny"]) == 2
    err = capsys.readouterr().err
    assert "dp=2 x cp=2 x tp=1 = 4 ranks, but the launched world size (WORLD_SIZE) is 1" in err
    assert main(["tiny", "--set", "parallel.ep=3"]) == 2
    assert "parallel.ep=3 must divide parallel.dp x parallel.cp = 4" in capsys.readouterr().err


def test_refusals_are_decided_before_any_worker_starts(capsys, monkeypatch, tmp_path):
    """A layout the model does not split, a named kernel that cannot run and a non-empty export
    folder: one message from the launching process, no worker started (``launch`` fails the
    test if called)."""

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(cli, "launch", no_workers)
    (tmp_path / "old.safetensors").write_bytes(b"")
    cases = [
        (["model.text.num_experts=5"], "parallel.ep=2 must divide model.text.num_experts=5"),
        (["model.expert_backend=te"], "model.expert_backend"),
        ([f"train.export_dir={tmp_path}"], "is not empty (it holds old.safetensors)"),
    ]
    for sets, message in cases:
        assert main(["tiny", *(a for s in sets for a in ("--set", s))]) == 2, sets
        err = capsys.readouterr().err
        assert err.count("qwen35-train:") == 1 and message in err, (sets, err)


def test_an_internal_error_has_its_own_exit_code(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "train", broken)
    one = ["--set", "parallel.dp=1", "--set", "parallel.cp=1", "--set", "parallel.ep=1"]
    assert main(["tiny", *one]) == cli.EXIT_INTERNAL == 4
    err = capsys.readouterr().err
    assert "internal error" in err and "RuntimeError: boom" in err


def test_torchrun_two_ranks(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "qwen35_trainer.cli",
        "tiny",
        "--set",
        "parallel.cp=1",
        "--set",
        "parallel.ep=1",
        "--set",
        "data.samples_per_rank=2",
        "--set",
        "train.steps=2",
        "--set",
        f"train.output_dir={tmp_path}",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_losses(done.stdout)) == 2, done.stdout  # rank 0 prints, rank 1 does not


@pytest.mark.parametrize("flag", ["--help"])
def test_help_names_outputs_and_builtin_recipes(capsys, flag):
    with pytest.raises(SystemExit):
        main([flag])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog
    assert "runs/<recipe>-<time>/" in out and "qwen35-train plan RECIPE" in out
    assert (
        "Built-in recipes: qwen3_5_122b_a10b_128k, qwen3_5_122b_a10b_lora, "
        "qwen3_5_122b_a10b_lora_fp8, qwen3_5_35b_a3b, qwen3_5_35b_a3b_lora, "
        "qwen3_5_35b_a3b_lora_fp8, qwen3_5_397b_a17b, qwen3_5_397b_a17b_lora, "
        "qwen3_5_397b_a17b_lora_fp8, qwen3_5_397b_a17b_pp, tiny" in out
    )


def test_a_worker_killed_by_a_signal_is_named_and_exits_128_plus_the_signal(monkeypatch):
    """The job's exit status when the last attempt's first failed worker was killed by signal 9
    (the agent's run gives the failure; test_faults.py kills a real worker): 128 + 9, the
    shell's convention; the agent's line for it names the signal."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from qwen35_trainer.supervise import launch as launching
    from qwen35_trainer.supervise.agent import how_it_ended

    class Killed:
        def __init__(self, *args, **kwargs):
            self.exit_codes = {}

        def run(self):
            failure = ProcessFailure(local_rank=1, pid=123, exitcode=-9, error_file="/nonexistent")
            return RunResult(state=WorkerState.FAILED, failures={1: failure})

    monkeypatch.setattr(launching, "SupervisingAgent", Killed)
    assert launching.launch(["tiny"], 2, 0) == 137
    assert how_it_ended(-9) == "was killed by signal 9 (SIGKILL)"
    assert how_it_ended(5) == "exited with code 5"


def test_version_names_every_workspace_package_torch_and_transformers():
    """``qwen35-train --version`` (a real process): one ``NAME VERSION`` line for the trainer and
    each package the workspace ships (every ``packages/*`` but the test-only dist-testkit, as
    their pyproject.toml files say), torch and transformers; exit 0."""
    import importlib.metadata
    import tomllib
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "qwen35_trainer.cli", "--version"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    root = Path(cli.__file__).parents[3]
    projects = [root / "integration", *sorted((root / "packages").iterdir())]
    want = {}
    for folder in projects:
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        if project["name"] != "dist-testkit":
            want[project["name"]] = project["version"]
    assert len(want) == 9, want
    want |= {name: importlib.metadata.version(name) for name in ("torch", "transformers")}
    assert said == want, done.stdout


def test_show_prints_the_recipe_yaml_of_a_run_of_the_same_command(capsys, monkeypatch, tmp_path):
    """``qwen35-train show tiny --set ...`` prints, byte for byte, the ``recipe.yaml`` a run of
    the same command writes, the command's run folder default included (``runs/tiny-<id>``, the
    launcher's run id pinned so the two agree); it builds no module and starts no process
    group. A bad recipe exits 2 with the reason."""
    import torch.distributed as dist
    from torch import nn

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "pinned")
    sets = [*ONE_PROCESS, *SYNTHETIC, "train.steps=1", "train.log_every=1"]
    args = [a for s in sets for a in ("--set", s)]

    def nothing_started(*args, **kwargs):
        raise AssertionError("show started something")

    with monkeypatch.context() as started:
        started.setattr(nn.Module, "__init__", nothing_started)
        started.setattr(dist, "init_process_group", nothing_started)
        assert main(["show", "tiny", *args]) == 0
    shown = capsys.readouterr().out
    assert not (tmp_path / "runs").exists()  # (init_process_group would have raised above)
    assert shown.startswith("# kernels this run ran") and "output_dir: runs/tiny-pinned\n" in shown
    assert main(["tiny", *args]) == 0
    assert (tmp_path / "runs" / "tiny-pinned" / "recipe.yaml").read_text() == shown
    assert main(["show", "tiny", "--set", "train.stepz=1"]) == 2
    assert "qwen35-train show: unknown recipe key(s) ['train.stepz']" in capsys.readouterr().err


def test_the_progress_bar_shows_the_held_out_loss_and_accuracy(capsys, monkeypatch):
    """On a terminal rank 0 draws a bar; a step that evaluated puts the held-out loss and
    accuracy in it (as the step line has them), and they stay until the next evaluation."""
    from qwen35_trainer.supervise.console import Console
    from qwen35_trainer.supervise.metrics import StepLog

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    console = Console(3, 1, printing=True)
    assert console.bar is not None
    plain = {"loss": 2.5, "ce": 2.5, "aux": 0.0, "grad_norm": 1.0, "tokens": 64, "seconds": 0.5}
    console.step(StepLog(1, **plain))
    assert "eval" not in console.bar.postfix
    console.step(StepLog(2, **plain, eval_loss=1.23456, eval_accuracy=0.375))
    assert "eval=1.2346, accuracy=0.375" in console.bar.postfix
    console.step(StepLog(3, **plain, eval_mtp_accuracy=None))
    assert console.bar.postfix.endswith("eval=1.2346, accuracy=0.375")
    console.close([], None)
    assert "eval=1.2346, accuracy=0.375" in capsys.readouterr().err  # what the terminal got
