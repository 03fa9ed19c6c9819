"""``qwen35-train``: the main job (the tiny recipe learns), errors, and a torchrun launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from helpers import TINY

from qwen35_trainer.cli import main

LINE = re.compile(r"^step +(\d+)/(\d+)  loss ([0-9.]+)  ce ([0-9.]+)  aux ([0-9.]+)  ")


def _losses(text: str) -> list[float]:
    return [float(m.group(3)) for m in map(LINE.match, text.splitlines()) if m]


def test_tiny_recipe_trains_and_the_loss_falls(capsys):
    """The README's main job: the whole tiny recipe, one process."""
    assert main([str(TINY)]) == 0
    out = capsys.readouterr().out
    losses = _losses(out)
    assert len(losses) == 60, out
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert out.strip().splitlines()[-1].startswith("done: steps 1..60 of 60")


def test_bad_recipe_exits_2_with_the_reason(capsys, tmp_path):
    assert main([str(TINY), "--set", "train.stepz=1"]) == 2
    assert "unknown recipe key(s) ['train.stepz']" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_layouts_that_do_not_fit_are_refused(capsys):
    assert main([str(TINY), "--set", "parallel.dp=2"]) == 2
    err = capsys.readouterr().err
    assert "dp=2 x cp=1 x tp=1 = 2 ranks, but the launched world size (WORLD_SIZE) is 1" in err
    assert main([str(TINY), "--set", "parallel.ep=3"]) == 2
    assert "parallel.ep=3 must divide parallel.dp x parallel.cp = 1" in capsys.readouterr().err


def test_torchrun_two_ranks():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "-m", "qwen35_trainer.cli", str(TINY), "--set", "parallel.dp=2",
           "--set", "data.samples_per_rank=2", "--set", "train.steps=2"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_losses(done.stdout)) == 2, done.stdout  # rank 0 prints, rank 1 does not
