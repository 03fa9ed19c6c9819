"""The command-line entry point, single process (a subprocess, as a user would run it)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

from setup_prewarm import cli


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "setup_prewarm.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "OMP_NUM_THREADS": "1"},
    )


def test_single_process_run_prints_the_report():
    done = run_cli("--mesh", "1x1", "--names", "dp,tp", "--flatten", "dp,tp", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[rank 0/1] prewarm on cpu"
    rows = {line.split()[0]: line.split()[1] for line in lines[3:]}
    assert rows == {"cublas": "skipped", "comm_groups": "ran", "fla": "skipped"}
    # at world 1 every dim (and the flattened one) is the default group: touched once
    assert "all-reduced 1 group(s): dp(1)" in done.stdout


def test_bad_arguments_exit_2_with_the_reason(capsys):
    assert cli.main(["--mesh", "2x2", "--names", "dp,tp", "--device", "cpu"]) == 2
    assert "--mesh 2x2 holds 4 ranks, world is 1" in capsys.readouterr().err
    assert cli.main(["--mesh", "2xq"]) == 2
    assert cli.main(["--mesh", "1", "--names", "dp,tp"]) == 2
    assert cli.main(["--mesh", "1x1", "--names", "dp,tp", "--flatten", "tp,dp"]) == 2
    assert cli.main(["--mesh", "1x1", "--names", "dp,dp"]) == 2


def test_console_script_ends_the_process_with_mains_code():
    """The command is :func:`cli.run`: :func:`cli.main`'s exit code, with no interpreter
    teardown after it (gloo's teardown abort would turn a finished prewarm into exit -6)."""
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "setup-prewarm"]
    assert script.load() is cli.run
    bad = "import sys; from setup_prewarm.cli import run; sys.argv[1:] = ['--mesh', '2xq']; run()"
    done = subprocess.run([sys.executable, "-c", bad], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--mesh" in done.stderr
