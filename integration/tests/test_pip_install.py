"""The trainer installs with plain pip outside uv, by the README's one command: all local
packages in one ``pip install`` (the workspace packages are not on PyPI, so ``pip install
./integration`` alone cannot resolve them). Checked as pip resolves it in a fresh virtual
environment (``--dry-run``: the local packages are built, every dependency is resolved against
the index, nothing is downloaded beyond metadata)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "pip install ./packages/*/ ./integration"  # the README's command, from the root
WORKSPACE = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


def test_the_readme_names_the_command():
    assert COMMAND in (ROOT / "README.md").read_text()
    assert COMMAND in (ROOT / "integration" / "README.md").read_text()


# An image's own torch that must stay (the GPU machines' 2.11 build, with its torchvision 0.26):
# the trainer's requirements must not replace it (torchvision>=0.29.2 did, pulling torch 2.15).
IMAGE_TORCH = "torch==2.11.0"


@pytest.mark.parametrize("keep", [None, IMAGE_TORCH], ids=["fresh", "beside-torch-2.11"])
def test_pip_resolves_the_trainer_in_a_fresh_environment(tmp_path, keep):
    venv.create(tmp_path / "env", with_pip=True)
    pip = tmp_path / "env" / ("Scripts" if sys.platform == "win32" else "bin") / "pip"
    targets = [f"./packages/{name}/" for name in WORKSPACE] + ["./integration"]
    report = tmp_path / "report.json"
    constraints = []
    if keep is not None:
        (tmp_path / "keep.txt").write_text(keep + "\n")
        constraints = ["--constraint", str(tmp_path / "keep.txt")]
    done = subprocess.run(
        [
            str(pip),
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            str(report),
            *constraints,
            *targets,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    installs = {
        i["metadata"]["name"]: i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    assert {"qwen35-trainer", "torch", "transformers", *WORKSPACE} <= set(installs)
    if keep is not None:
        assert installs["torch"] == keep.split("==")[1]


def test_the_wheel_built_from_the_sdist_carries_the_recipes(tmp_path):
    """``uv build`` makes the sdist, then the wheel FROM the sdist: the top-level ``recipes/``
    lands inside the package, and ``qwen35-train tiny --help`` run from the unpacked wheel
    (imported ahead of the workspace's source tree) lists the built-in recipes it found."""
    import shutil
    import zipfile

    uv = shutil.which("uv")
    command = [uv] if uv else [sys.executable, "-m", "uv"]
    done = subprocess.run(
        [*command, "build", str(ROOT / "integration"), "-o", str(tmp_path / "dist")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("qwen35_trainer-*.whl")
    assert len(list((tmp_path / "dist").glob("qwen35_trainer-*.tar.gz"))) == 1
    shipped = {p.removeprefix("qwen35_trainer/recipes/") for p in zipfile.ZipFile(wheel).namelist()}
    expected = {p.name for p in (ROOT / "recipes").iterdir()}
    assert expected <= shipped and "tiny.yaml" in expected
    zipfile.ZipFile(wheel).extractall(tmp_path / "wheel")
    show = (
        "import sys, qwen35_trainer; from qwen35_trainer.cli import main; "
        "print(qwen35_trainer.__file__, flush=True); main(['tiny', '--help'])"
    )
    run = subprocess.run(
        [sys.executable, "-c", show],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "wheel")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    where, usage = run.stdout.split("\n", 1)
    assert where.startswith(str(tmp_path / "wheel"))
    listed = " ".join(usage.split()).split("Built-in recipes: ")[1]
    assert listed.startswith("qwen3_5_122b_a10b_128k, qwen3_5_122b_a10b_lora, qwen3_5_122b_a10b")
    assert "qwen3_5_397b_a17b_lora_fp8, qwen3_5_397b_a17b_pp, tiny" in listed


def test_the_readme_commands_bring_uv():
    """The two commands of the top-level README and the trainer's README work on a machine
    with Python but no uv: every ``uv run`` line first installs uv when it is missing."""
    for readme in (ROOT / "README.md", ROOT / "integration" / "README.md"):
        block = readme.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
        commands = [line for line in block.splitlines() if line and not line.startswith("#")]
        assert len(commands) == 2, (readme, commands)
        for line in commands:
            bootstrap, run = line.split("; ", 1)
            assert bootstrap == "python3 -m uv -V || python3 -m pip install uv", line
            assert run.startswith("python3 -m uv run "), line
