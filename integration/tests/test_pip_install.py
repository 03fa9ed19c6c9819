"""The trainer installs with plain pip outside uv, by the README's one command: all local
packages in one ``pip install`` (the workspace packages are not on PyPI, so ``pip install
./integration`` alone cannot resolve them). Checked as pip resolves it in a fresh virtual
environment (``--dry-run``: the local packages are built, every dependency is resolved against
the index, nothing is downloaded beyond metadata)."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "pip install ./packages/*/ ./integration"  # the README's command, from the root
WORKSPACE = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


def test_the_readme_names_the_command():
    assert COMMAND in (ROOT / "README.md").read_text()
    assert COMMAND in (ROOT / "integration" / "README.md").read_text()


def test_pip_resolves_the_trainer_in_a_fresh_environment(tmp_path):
    venv.create(tmp_path / "env", with_pip=True)
    pip = tmp_path / "env" / ("Scripts" if sys.platform == "win32" else "bin") / "pip"
    targets = [f"./packages/{name}/" for name in WORKSPACE] + ["./integration"]
    report = tmp_path / "report.json"
    done = subprocess.run(
        [str(pip), "install", "--dry-run", "--quiet", "--report", str(report), *targets],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    names = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert {"qwen35-trainer", "torch", "transformers", *WORKSPACE} <= names
