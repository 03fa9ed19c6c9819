"""Every GPU check of the workspace as one unattended run, shared by two entry points.

- ``uv run nox -s gpu``: on a CUDA machine with a package index; each member's checks run in an
  environment uv builds from the lock with the member's ``gpu`` extra (wheels only) and the
  opt-in kernel extras asked for (``-- --with-extra te``, :data:`OPT_IN_EXTRAS`).
- ``python3 tools/gpu_checks.py --wheelhouse DIR``: on a CUDA machine WITHOUT a package index
  (an air-gapped cluster node, a GPU box lent for a few minutes). The checks run in the
  interpreter that runs this script, on ITS torch build (the one matching the machine's
  driver), with the wheels of ``uv run nox -s wheelhouse -- DIR`` (made where an index is
  reachable) installed for the run only: ``pip install --no-index --no-deps --target SITE``,
  with SITE put first on ``PYTHONPATH`` of every check. Nothing of the interpreter's own
  packages is changed.

Both take the same extras (:func:`extra_args`): :data:`GPU_EXTRA` always, each of
:data:`OPT_IN_EXTRAS` only when asked (a wheelhouse carries the opt-in kernels only when
``nox -s wheelhouse`` is asked for them). :func:`wheel_gaps` names the pins of an install that
``uv.lock`` holds no Linux x86-64 wheel of (``integration/tests/test_gpu_install.py`` keeps the
``gpu`` extras at none; ``nox -s gpu_install`` installs them from wheels alone).

The checks: every member's ``@pytest.mark.gpu`` tests (pytest's exit code 5, "no test
selected", passes: the member has none), the GPU benchmarks, and a one-GPU bf16 smoke run of
the tiny recipe (20 steps; the loss must fall). Both entry points refuse to start without CUDA,
so a run whose GPU tests all skipped is never reported as a pass. Tests that need what this
machine lacks (a second GPU, a kernel package with no wheel) skip with their reason, and the
script's first lines say which kernel packages it found.

Standard library only (the script runs before anything is installed); ``packaging`` is imported
by the functions that read ``uv export`` and ``uv.lock`` alone, which run where the index is.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.parse
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# GPU benchmarks: (member, script, arguments), sized to finish in about a minute each on one H200.
GPU_BENCHMARKS = [
    ("chunked-loss", "benchmarks/bench_loss.py",
     ["--device", "cuda", "--dtype", "bf16", "--tokens", "8192", "--hidden", "3072",
      "--timeout", "180"]),
    # the measured step-time model's error on this GPU, for the tiny recipe and Qwen3.5-35B-A3B's
    # widths on one GPU: plan --measure, then a real run's step; then each row's counted tensors
    # against the CUDA allocator's peak of one step
    ("qwen35-trainer", "benchmarks/bench_time_model.py",
     ["--recipes", "tiny", "35b-shaped", "--rows", "one process", "one process, AC"]),
]  # fmt: skip

GPU_SMOKE = """
import torch
from qwen35_trainer import load_recipe, train
assert torch.cuda.is_available(), "the GPU smoke run needs CUDA"
recipe = load_recipe("tiny", ["train.steps=20", "train.dtype=bfloat16", "parallel.dp=1",
                             "parallel.cp=1", "parallel.ep=1"])
logs = train(recipe, on_step=lambda log: print(log, flush=True)).logs
assert logs[-1].loss < 0.8 * logs[0].loss, (logs[0].loss, logs[-1].loss)
print("gpu smoke: tiny recipe in bf16 on one GPU, loss", logs[0].loss, "->", logs[-1].loss)
"""

# The members' GPU install: every member's ``gpu`` extra installs from wheels alone (fla,
# megatron-fsdp; attention, experts and AdamW run torch's own CUDA kernels). The opt-in kernel
# extras build from source where no wheel matches the torch build (README "On GPUs").
GPU_EXTRA = "gpu"
OPT_IN_EXTRAS = {
    "flash-attn": "flash-attn's varlen attention (cp-varlen-attn backend='flash')",
    "te": "TransformerEngine's grouped GEMM (moe-parallel) and FusedAdam (safe-optim)",
}
# What a GPU user types (after ``uv sync``'s own): the CI check adds ``--no-build``
GPU_INSTALL = ("--frozen", "--all-packages", "--extra", GPU_EXTRA)

# The GPU kernel packages the extras bring (import name: distribution, opt-in extra or "").
KERNEL_PACKAGES = {
    "fla": ("flash-linear-attention", ""),
    "megatron_fsdp": ("megatron-fsdp", ""),
    "flash_attn": ("flash-attn", "flash-attn"),
    "transformer_engine": ("transformer-engine", "te"),
}

# The Linux x86-64 CPython versions the GPU install is kept wheel-only for.
WHEEL_PYTHONS = ("3.11", "3.12")

# What a wheelhouse never carries: the target's own torch build, which matches its driver.
TARGET_OWN = ("torch", "torchvision", "torchaudio", "triton")
TARGET_OWN_PREFIXES = ("nvidia-", "cuda-")


def members(root: Path = ROOT) -> dict[str, Path]:
    """The workspace members by distribution name: every package, then the trainer."""
    found = {
        p.name: p for p in sorted((root / "packages").iterdir()) if (p / "pyproject.toml").exists()
    }
    found["qwen35-trainer"] = root / "integration"
    return found


def suite_env() -> dict[str, str | None]:
    """The environment of every test process (``None``: unset).

    One Inductor cache shared by every run (the first ``torch.compile`` costs ~15 s on CPU). A
    module FSDP2 wraps must not return a view: an error in the ranks and runs the tests start
    too (pytest's own filter, in pyproject.toml, covers only its process). Bytecode is written
    (``PYTHONDONTWRITEBYTECODE`` unset where the machine sets it): uv installs no ``.pyc``
    files, and without them every process (each rank of a gloo launch, each worker, each CLI
    run) compiled torch's and transformers' sources again: importing the trainer took 15 s
    instead of 7."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".inductor-cache"),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "error:FSDP2-wrapped module:UserWarning",
        "PYTHONDONTWRITEBYTECODE": None,
    }


def extra_args(defined: Iterable[str], opt_in: Sequence[str] = ()) -> list[str]:
    """``--extra`` arguments of a ``uv sync`` / ``uv export`` of a member (or the workspace)
    whose ``defined`` extras are given: the ``gpu`` extra and each opt-in of ``opt_in`` it
    defines. ``ValueError`` for an opt-in that is not one of :data:`OPT_IN_EXTRAS`."""
    unknown = [e for e in opt_in if e not in OPT_IN_EXTRAS]
    if unknown:
        raise ValueError(
            f"unknown opt-in extra(s) {unknown}; expected some of {list(OPT_IN_EXTRAS)}"
        )
    defined = set(defined)
    return [arg for e in (GPU_EXTRA, *opt_in) if e in defined for arg in ("--extra", e)]


def defined_extras(member: Path) -> set[str]:
    """The optional-dependency extras the member at ``member`` defines."""
    with open(member / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f).get("project", {}).get("optional-dependencies", {}))


def canonical(name: str) -> str:
    """A distribution name as package indexes compare them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def target_pins(exported: str, python_version: str) -> list[str]:
    """The ``name==version`` pins of ``exported`` (the text of ``uv export``: pins with
    environment markers) that a Linux x86-64 CPython ``python_version`` installs: a pin whose
    marker excludes that target is no requirement there at all."""
    from packaging.markers import Marker

    major_minor = ".".join(python_version.split(".")[:2])
    env = {
        "python_version": major_minor,
        "python_full_version": python_version
        if python_version.count(".") == 2
        else f"{major_minor}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    pins = []
    for line in exported.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith(("-", "\\")):
            continue
        pin, _, marker = (part.strip() for part in line.partition(";"))
        if "==" not in pin:
            raise ValueError(f"uv export gave {line!r}; expected name==version [; marker]")
        if not marker or Marker(marker).evaluate(env):
            pins.append(pin)
    return pins


def wheelhouse_requirements(
    exported: str, python_version: str, have: set[str], without: set[str]
) -> tuple[list[str], dict[str, str]]:
    """(the ``name==version`` pins to download, {name: why it is left out}) from ``exported``,
    the text of ``uv export``, for a Linux x86-64 CPython ``python_version`` target
    (:func:`target_pins`). Left out: the target's own torch build (:data:`TARGET_OWN`, the CUDA
    libraries), what the target already has (``have``) and what the caller leaves out
    (``without``)."""
    have = {canonical(n) for n in have}
    without = {canonical(n) for n in without}
    pins, left = [], {}
    for pin in target_pins(exported, python_version):
        name = canonical(pin.split("==", 1)[0].split("[", 1)[0])
        if name in TARGET_OWN or name.startswith(TARGET_OWN_PREFIXES):
            left[name] = "the target's own torch build"
        elif name in have:
            left[name] = "the target has it"
        elif name in without:
            left[name] = "named by --without"
        else:
            pins.append(pin)
    return pins, left


def wheel_gaps(lock_text: str, pins: Iterable[str], python_version: str) -> dict[str, str]:
    """``{pin: why}`` for each ``name==version`` of ``pins`` that ``uv.lock`` (its text) holds
    no wheel of for a Linux x86-64 CPython ``python_version`` (a manylinux / linux x86_64 or
    ``any`` wheel whose tag takes that interpreter): what an install of those pins would have
    to build from source. ``ValueError`` for a pin the lock does not hold."""
    wheels = {
        (canonical(p["name"]), p["version"]): [
            urllib.parse.unquote(w["url"].rsplit("/", 1)[-1]) for w in p.get("wheels", [])
        ]
        for p in tomllib.loads(lock_text)["package"]
        if "version" in p
    }
    gaps = {}
    for pin in pins:
        name, version = pin.split("==", 1)
        files = wheels.get((canonical(name.split("[", 1)[0]), version))
        if files is None:
            raise ValueError(f"{pin} is not in uv.lock (is the export from the same lock?)")
        if not files:
            gaps[pin] = "a source distribution only"
        elif not any(_fits(f, python_version) for f in files):
            gaps[pin] = f"no wheel for CPython {python_version} on Linux x86-64 among {len(files)}"
    return gaps


def _fits(wheel: str, python_version: str) -> bool:
    from packaging.utils import parse_wheel_filename

    minor = int(python_version.split(".")[1])
    cp = f"cp3{minor}"
    for tag in parse_wheel_filename(wheel)[3]:
        linux = tag.platform == "any" or (
            tag.platform.startswith(("manylinux", "linux_")) and tag.platform.endswith("_x86_64")
        )
        stable_abi = tag.abi == "abi3" and tag.interpreter[:3] == "cp3"
        interpreter = tag.interpreter in (cp, "py3", f"py3{minor}") or (
            stable_abi and int(tag.interpreter[3:]) <= minor
        )
        if linux and interpreter and tag.abi in ("none", "abi3", cp):
            return True
    return False


def _install(wheelhouse: Path, site: Path) -> None:
    wheels = sorted(wheelhouse.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu_checks: no wheels in {wheelhouse} (make them: nox -s wheelhouse)")
    if importlib.util.find_spec("pip") is None:
        raise SystemExit(
            f"gpu_checks: --wheelhouse installs with pip, which {sys.executable} lacks "
            "(python3 -m ensurepip adds it)"
        )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)],
        check=True,
    )  # fmt: skip


def _steps(root: Path) -> list[tuple[str, list[str], Path, tuple[int, ...]]]:
    """(name, command, folder, passing exit codes) of every check, in order."""
    py = sys.executable
    steps = [
        (
            f"{name}: gpu tests",
            [py, "-m", "pytest", "tests", "-m", "gpu", "-q", "-rs"],
            path,
            (0, 5),
        )
        for name, path in members(root).items()
    ]
    for name, script, args in GPU_BENCHMARKS:
        steps.append((f"{name}: {script}", [py, script, *args], members(root)[name], (0,)))
    steps.append(("qwen35-trainer: bf16 smoke run", [py, "-c", GPU_SMOKE], root, (0,)))
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--wheelhouse", type=Path, help="install these wheels for the run")
    parser.add_argument("--log-dir", type=Path, help="write each check's whole output here")
    args = parser.parse_args(argv)
    import torch  # the interpreter's own build

    if not torch.cuda.is_available():
        print(
            f"gpu_checks: needs a CUDA GPU; this interpreter's torch {torch.__version__} sees "
            "none (torch.cuda.is_available() is False), so every GPU test would skip",
            file=sys.stderr,
        )
        return 2
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update({k: v for k, v in suite_env().items() if v is not None}, OMP_NUM_THREADS="4")
    with tempfile.TemporaryDirectory(prefix="gpu-checks-site-") as site:
        if args.wheelhouse is not None:
            _install(args.wheelhouse, Path(site))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
        return _run(_steps(ROOT), env, args.log_dir, torch)


def _run(steps, env, log_dir: Path | None, torch) -> int:
    print(
        f"gpu_checks: torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
        flush=True,
    )
    found = subprocess.run(
        [sys.executable, "-c", _FIND_KERNELS], env=env, capture_output=True, text=True
    ).stdout.strip()
    print(f"gpu_checks: kernel packages: {found}", flush=True)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for i, (name, command, cwd, ok) in enumerate(steps):
        start = time.monotonic()
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
        output = done.stdout + done.stderr
        if log_dir is not None:
            (log_dir / f"{i:02d}-{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}.log").write_text(output)
        lines = output.strip().splitlines()
        verdict = "PASS" if done.returncode in ok else "FAIL"
        print(
            f"{verdict} {name} (exit {done.returncode}, {time.monotonic() - start:.0f} s): "
            f"{lines[-1] if lines else ''}",
            flush=True,
        )
        if verdict == "FAIL":
            failed.append(name)
            print("\n".join("    " + line for line in lines[-40:]), flush=True)
        else:  # the skip reasons (-rs) say what this machine could not check
            for line in lines:
                if line.startswith("SKIPPED"):
                    print("    " + line, flush=True)
    print(f"gpu_checks: {len(steps) - len(failed)} of {len(steps)} passed", flush=True)
    return 1 if failed else 0


_FIND_KERNELS = f"""
import importlib.util
names = {KERNEL_PACKAGES!r}
print(", ".join(f"{{dist}} {{'found' if importlib.util.find_spec(mod) else 'ABSENT'}}"
                + (f" (opt-in extra {{extra}})" if extra else "")
                for mod, (dist, extra) in names.items()))
"""

if __name__ == "__main__":
    sys.exit(main())
