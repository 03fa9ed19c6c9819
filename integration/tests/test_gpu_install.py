"""The GPU install stays wheel-only: every package that ``uv sync --frozen --all-packages --extra
gpu`` installs (the members' default ``gpu`` extras) has a wheel in ``uv.lock`` for Linux
x86-64 CPython 3.11 and 3.12, so a GPU machine builds nothing but the workspace's own packages.
The packages come from ``uv export`` of the lock (uv's own resolution of the extras, markers
included), their wheels from ``uv.lock`` itself (``tools/gpu_checks.py``'s :func:`wheel_gaps`).
The real install, in a fresh environment with ``--no-build``, is ``nox -s gpu_install``, which
``.ci/run`` runs after the tests."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gpu_checks():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "tools" / "gpu_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _export(*extras: str) -> str:
    uv = shutil.which("uv")
    command = [uv] if uv else [sys.executable, "-m", "uv"]
    done = subprocess.run(
        [*command, "export", "--frozen", "--no-hashes", "--no-header", "--no-annotate",
         "--no-emit-workspace", "--all-packages", *(a for e in extras for a in ("--extra", e))],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def _gaps(exported: str) -> dict[str, str]:
    checks, lock = _gpu_checks(), (ROOT / "uv.lock").read_text()
    return {
        f"{pin} (CPython {python})": why
        for python in checks.WHEEL_PYTHONS
        for pin, why in checks.wheel_gaps(
            lock, checks.target_pins(exported, python), python
        ).items()
    }


def test_every_package_of_the_gpu_extras_has_a_linux_x86_64_wheel_in_the_lock():
    checks = _gpu_checks()
    exported = _export(checks.GPU_EXTRA)
    names = {pin.split("==")[0] for pin in checks.target_pins(exported, "3.12")}
    assert {"torch", "flash-linear-attention", "fla-core", "megatron-fsdp"} <= names
    gaps = _gaps(exported)
    assert not gaps, (
        "the gpu extras must install from wheels on Linux x86-64; these would build from "
        "source (move them to an opt-in extra, or pin a release with wheels):\n"
        + "\n".join(f"  {pin}: {why}" for pin, why in sorted(gaps.items()))
    )


def test_the_opt_in_kernel_extras_are_the_source_builds():
    """The same check over the opt-in extras names exactly the two kernel packages that moved
    out of ``gpu``: it fails where a package has no wheel."""
    checks = _gpu_checks()
    gaps = _gaps(_export(checks.GPU_EXTRA, *checks.OPT_IN_EXTRAS))
    assert gaps == {
        f"{pin} (CPython {python})": "a source distribution only"
        for pin in ("flash-attn==2.8.3.post2", "transformer-engine-torch==2.20.2")
        for python in checks.WHEEL_PYTHONS
    }


LOCK = """
version = 1

[[package]]
name = "pure"
version = "1.0"
wheels = [{ url = "https://example/pure-1.0-py3-none-any.whl" }]

[[package]]
name = "native"
version = "2.0"
wheels = [
    { url = "https://example/native-2.0-cp311-cp311-manylinux_2_28_x86_64.whl" },
    { url = "https://example/native-2.0-cp312-cp312-manylinux_2_28_aarch64.whl" },
]

[[package]]
name = "stable-abi"
version = "3.0"
wheels = [{ url = "https://example/stable_abi-3.0-cp39-abi3-manylinux2014_x86_64.whl" }]

[[package]]
name = "source-only"
version = "4.0"
sdist = { url = "https://example/source_only-4.0.tar.gz" }
"""


def test_wheel_tags_are_read_for_the_target():
    gaps = _gpu_checks().wheel_gaps
    pins = ["pure==1.0", "native==2.0", "stable-abi==3.0", "source-only==4.0"]
    assert gaps(LOCK, pins, "3.11") == {"source-only==4.0": "a source distribution only"}
    assert gaps(LOCK, pins, "3.12") == {
        "native==2.0": "no wheel for CPython 3.12 on Linux x86-64 among 2",
        "source-only==4.0": "a source distribution only",
    }
