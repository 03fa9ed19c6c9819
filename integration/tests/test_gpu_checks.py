"""``tools/gpu_checks.py``: the repository's GPU checks as one run, also on a CUDA machine with no
package index (its wheels from ``nox -s wheelhouse``). What a CPU machine can check: which
pins a wheelhouse takes from the lock, and that the run refuses to start without CUDA."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_checks.py"


def _gpu_checks():
    spec = importlib.util.spec_from_file_location("gpu_checks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXPORTED = """\
# a comment
av==18.1.0 ; python_full_version < '3.12'
av==19.0.2 ; python_full_version >= '3.12'
colorama==0.4.6 ; sys_platform == 'win32'
Flash_Linear.Attention==0.6.0
nvidia-cublas==13.4.1.3 ; sys_platform == 'linux'
pandas==3.1.1
torch==2.15.0
triton==3.9.0 ; python_full_version < '3.16' and sys_platform == 'linux'
wandb==0.31.0
"""


def test_a_wheelhouse_takes_the_targets_pins_and_leaves_out_what_it_has():
    pins, left = _gpu_checks().wheelhouse_requirements(
        EXPORTED, "3.12", have={"PANDAS"}, without={"wandb"}
    )
    # the marker picks the target's av; colorama is no requirement on Linux at all
    assert pins == ["av==19.0.2", "Flash_Linear.Attention==0.6.0"]
    assert left == {
        "nvidia-cublas": "the target's own torch build",
        "torch": "the target's own torch build",
        "triton": "the target's own torch build",
        "pandas": "the target has it",
        "wandb": "named by --without",
    }
    pins, _ = _gpu_checks().wheelhouse_requirements(EXPORTED, "3.11", set(), set())
    assert pins == ["av==18.1.0", "Flash_Linear.Attention==0.6.0", "pandas==3.1.1", "wandb==0.31.0"]


def _wheelhouse_names(*opt_in: str) -> tuple[set[str], dict[str, str]]:
    """The real ``uv export`` of the lock as ``nox -s wheelhouse [--with-extra ...]`` makes it."""
    checks = _gpu_checks()
    extras = checks.extra_args({checks.GPU_EXTRA, *checks.OPT_IN_EXTRAS}, opt_in)
    uv = shutil.which("uv")
    command = [uv] if uv else [sys.executable, "-m", "uv"]
    done = subprocess.run(
        [*command, "export", "--frozen", "--no-emit-workspace", "--no-hashes", "--no-header",
         "--no-annotate", "--no-default-groups", "--all-packages", *extras, "--group", "test"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    pins, left = checks.wheelhouse_requirements(done.stdout, "3.12", set(), set())
    return {pin.split("==")[0] for pin in pins}, left


def test_the_locks_export_gives_the_gpu_extras_without_torch():
    """As ``nox -s wheelhouse`` reads it: the gpu extras' kernel packages are pinned, torch and
    its CUDA libraries are not, and the opt-in kernels only when asked for."""
    names, left = _wheelhouse_names()
    assert {"flash-linear-attention", "fla-core", "megatron-fsdp", "datasets"} <= names
    assert not names & {"torch", "torchvision", "triton", "flash-attn", "transformer-engine"}
    assert not any(n.startswith("nvidia-") for n in names)
    assert left["torch"] == "the target's own torch build"
    names, _ = _wheelhouse_names("te")
    assert "transformer-engine-torch" in names and "flash-attn" not in names


def test_the_gpu_runs_take_the_gpu_extra_and_the_opt_ins_asked_for():
    extra_args = _gpu_checks().extra_args
    assert extra_args({"gpu", "flash-attn"}) == ["--extra", "gpu"]
    assert extra_args({"gpu", "flash-attn"}, ["flash-attn", "te"]) == [
        "--extra", "gpu", "--extra", "flash-attn",
    ]  # fmt: skip
    assert extra_args({"te"}, ["te"]) == ["--extra", "te"]
    with pytest.raises(ValueError, match=r"unknown opt-in extra\(s\) \['gpu-all'\]"):
        extra_args({"gpu"}, ["gpu-all"])


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_the_run_refuses_to_start_without_cuda(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--wheelhouse", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "gpu_checks: needs a CUDA GPU" in done.stderr
    assert "Traceback" not in done.stderr
