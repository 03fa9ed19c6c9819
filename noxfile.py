"""Sessions: ``tests`` (one per package, each in its own environment), ``lint``, ``bench``,
``gpu`` (everything that needs a CUDA GPU, as one unattended run), ``gpu_install`` (the GPU
install a user types, from wheels alone, checked on any Linux x86-64 machine) and ``wheelhouse``
(the wheels that let ``tools/gpu_checks.py`` run the same GPU checks on a machine without a
package index).

Each ``tests`` environment is built with ``uv sync --package <name> --group test`` from the
committed lock, so it holds ONLY that package, its own dependencies and its test group: a
package that forgets to declare a dependency fails here, not on a user's machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "tools"))
from gpu_checks import (
    GPU_BENCHMARKS,
    GPU_EXTRA,
    GPU_INSTALL,
    GPU_SMOKE,
    OPT_IN_EXTRAS,
    defined_extras,
    extra_args,
    members,
    suite_env,
    wheelhouse_requirements,
)

ROOT = Path(__file__).parent
MEMBERS = members(ROOT)

# Suites that must also pass against another release of an optional dependency: after the main
# run (on the locked release), the listed requirement is installed over it and the listed
# tests run again.
ALSO_AGAINST = {
    "fsdp-compat": [
        ("megatron-fsdp==0.5.1", ("tests/test_megatron_adapter.py", "tests/test_megatron_cpu.py"))
    ],
}

# The trainer's suite on two pytest-xdist workers, one test file per worker at a time (a file's
# module-scoped gloo launches stay in one process): many of its tests run in one single-threaded
# process, which leaves the second core idle (cold Inductor cache: 1268 s on two workers; 1425 s
# on one, before the compiled TP layout joined). Its files go out longest first, in the order
# integration/tests/conftest.py gives them, not xdist's (most tests first). The package suites
# stay on one worker: their time is mostly gloo launches that keep both cores busy, and on two
# workers they took longer (cp-varlen-attn 203 s against 162 s, chunked-loss 97 s against 92 s).
PYTEST_ARGS = {"qwen35-trainer": ("-n", "2", "--dist", "loadfile", "--no-loadscope-reorder")}
# every suite prints its slowest 15 tests (a module's gloo launch is its first test's setup), so
# each CI log says where the time went
DURATIONS = ("--durations", "15")

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["tests", "lint"]


def _sync(session: nox.Session, package: str, *extra: str) -> None:
    """Install exactly ``package`` + its test group from uv.lock into the session's venv."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--no-default-groups",
        "--package",
        package,
        "--group",
        "test",
        *extra,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def _has_group(path: Path, group: str) -> bool:
    with open(path / "pyproject.toml", "rb") as f:
        return group in tomllib.load(f).get("dependency-groups", {})


@nox.session
@nox.parametrize("package", list(MEMBERS))
def tests(session: nox.Session, package: str) -> None:
    """Run one package's suite in an environment that holds only that package."""
    _sync(session, package)
    session.chdir(MEMBERS[package])
    args = (*PYTEST_ARGS.get(package, ()), *DURATIONS, *session.posargs)
    session.run("pytest", "tests", *args, env=suite_env())
    for requirement, tests_paths in ALSO_AGAINST.get(package, []):
        session.run_install(
            "uv",
            "pip",
            "install",
            "--python",
            session.virtualenv.location,
            requirement,
            external=True,
        )
        session.run("pytest", *tests_paths, *session.posargs, env=suite_env())


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the whole repository."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def bench(session: nox.Session) -> None:
    """Run every package's benchmarks/ scripts (each prints its own comparison table)."""
    for package, path in MEMBERS.items():
        scripts = (
            sorted((path / "benchmarks").glob("*.py")) if (path / "benchmarks").is_dir() else []
        )
        if not scripts:
            continue
        # a package's benchmark peers live in its optional "bench" dependency group
        _sync(session, package, *(("--group", "bench") if _has_group(path, "bench") else ()))
        for script in scripts:
            session.run("python", str(script), *session.posargs, env=suite_env())


def _opt_in(session: nox.Session, prog: str) -> list[str]:
    """The opt-in kernel extras named by ``-- --with-extra NAME ...`` (:data:`OPT_IN_EXTRAS`)."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--with-extra", nargs="+", default=[], choices=list(OPT_IN_EXTRAS))
    return parser.parse_args(session.posargs).with_extra


@nox.session
def gpu(session: nox.Session) -> None:
    """Every GPU check as one unattended run (what runs: ``tools/gpu_checks.py``): each
    member's ``@pytest.mark.gpu`` tests in an environment uv builds with the member's ``gpu``
    extra (wheels only) and the opt-in kernel extras of ``-- --with-extra flash-attn te``
    (source builds where no wheel matches the torch build: README "On GPUs"), the GPU
    benchmarks, the bf16 smoke run of the tiny recipe. Refuses to start without CUDA, so it
    never reports skipped GPU tests as a pass. Without a package index: ``nox -s wheelhouse``
    where there is one, then ``python3 tools/gpu_checks.py --wheelhouse DIR`` on the GPU
    machine."""
    opt_in = _opt_in(session, "nox -s gpu --")
    if shutil.which("nvidia-smi") is None:
        session.error("nox -s gpu needs a CUDA GPU: nvidia-smi is not on PATH")
    env = {**suite_env(), "OMP_NUM_THREADS": "4"}
    for package, path in MEMBERS.items():
        _sync(session, package, *extra_args(defined_extras(path), opt_in))
        session.chdir(path)
        # exit code 5: the package has no GPU test
        session.run("pytest", "tests", "-m", "gpu", "-q", "-rs", env=env, success_codes=[0, 5])
    for package, script, args in GPU_BENCHMARKS:
        path = MEMBERS[package]
        _sync(session, package, *(("--group", "bench") if _has_group(path, "bench") else ()))
        session.chdir(path)
        session.run("python", script, *args, env=env)
    trainer = MEMBERS["qwen35-trainer"]
    _sync(session, "qwen35-trainer", *extra_args(defined_extras(trainer), opt_in))
    session.chdir(ROOT)
    session.run("python", "-c", GPU_SMOKE, env=env)


# What gpu_install imports in the environment it builds, and the kernel report it prints there.
_GPU_INSTALL_CHECK = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from qwen35_trainer import load_recipe
from qwen35_trainer.model.kernels import resolve_kernels
for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
    kernels = resolve_kernels(load_recipe("tiny", [f"train.dtype={dtype}"]), device)
    print(f"{device} ({dtype}): {kernels.line()}")
    for warning in kernels.fallbacks:
        print("   WARNING", warning)
    assert device == "cpu" or not kernels.fallbacks, "the gpu extras leave a slow path on CUDA"
"""


@nox.session(venv_backend="none")
def gpu_install(session: nox.Session) -> None:
    """The GPU install a user types, ``uv sync --frozen --all-packages --extra gpu``, checked on
    this machine (no GPU needed) with ``--no-build``: uv installs every package from a wheel and
    builds only the workspace members, into a fresh environment in a temporary folder (never
    the CPU test environment: with fla + triton there transformers' Qwen3.5 fails on CPU).
    Then every member and the gpu extras' kernel packages are imported there, and the kernel
    report that install gives on CUDA in bf16 must have no slow path (a CPU machine resolves
    it without running it). uv's cache makes a repeat take seconds."""
    with tempfile.TemporaryDirectory(prefix="gpu-install-") as folder:
        start = time.monotonic()
        done = subprocess.run(
            ["uv", "sync", *GPU_INSTALL, "--no-build"],
            cwd=ROOT, env={**os.environ, "UV_PROJECT_ENVIRONMENT": folder},
            capture_output=True, text=True,
        )  # fmt: skip
        output = done.stdout + done.stderr
        session.log(
            f"uv sync {' '.join(GPU_INSTALL)} --no-build ({time.monotonic() - start:.1f} s):"
        )
        print(output, flush=True)
        if done.returncode:
            session.error(
                "uv sync --no-build failed (above): the gpu extras must install from wheels alone"
            )
        built = set(re.findall(r"Building (\S+) @ ", output))
        if not built <= set(MEMBERS):
            session.error(
                f"uv built {sorted(built - set(MEMBERS))}, which are not workspace members"
            )
        modules = [name.replace("-", "_") for name in MEMBERS] + ["fla", "megatron_fsdp"]
        session.run(
            f"{folder}/bin/python", "-c", _GPU_INSTALL_CHECK, *modules,
            env={"PYTHONWARNINGS": "ignore"}, external=True,
        )  # fmt: skip


# The target of a wheelhouse by default: a Linux x86-64 CPython (manylinux wheels).
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                   "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip


@nox.session(venv_backend="none")
def wheelhouse(session: nox.Session) -> None:
    """Wheels for ``tools/gpu_checks.py`` on a CUDA machine without a package index, made where
    the index is: ``nox -s wheelhouse -- DIR [--python 3.12] [--have FILE] [--without NAME
    ...] [--with-extra flash-attn te]``. DIR gets every workspace member's wheel and the lock's
    pins (every member with its ``gpu`` extra and test group, plus the opt-in kernel extras
    ``--with-extra`` names, then chunked-loss's benchmark peers) as wheels for that Python on
    Linux x86-64, except the target's own torch build (torch, torchvision, torchaudio, triton,
    the CUDA libraries), what ``--have`` lists (a ``pip freeze`` or ``pip list`` of the target,
    one name per line) and what ``--without`` names. A pin with no wheel for the target (an
    opt-in kernel package that only has a source distribution) is named at the end, with the
    size of DIR."""
    parser = argparse.ArgumentParser(prog="nox -s wheelhouse --")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--python", default="3.12", help="the target's Python (default 3.12)")
    parser.add_argument("--have", type=Path, help="the target's installed distributions")
    parser.add_argument("--without", nargs="*", default=[], help="distributions to leave out")
    parser.add_argument(
        "--with-extra", nargs="+", default=[], choices=list(OPT_IN_EXTRAS),
        help="opt-in kernel extras to carry too",
    )  # fmt: skip
    args = parser.parse_args(session.posargs)
    have = set()
    if args.have is not None:
        for line in args.have.read_text().splitlines():
            words = line.replace("==", " ").split()
            if words and not set(words[0]) <= set("-"):
                have.add(words[0])
    args.dir.mkdir(parents=True, exist_ok=True)
    session.run("uv", "build", "--all-packages", "--wheel", "-o", str(args.dir), external=True)
    export = ("uv", "export", "--frozen", "--no-emit-workspace", "--no-hashes", "--no-header",
              "--no-annotate", "--no-default-groups")  # fmt: skip
    pins, left = {}, {}
    extras = extra_args({GPU_EXTRA, *OPT_IN_EXTRAS}, args.with_extra)
    for scope in (("--all-packages", *extras, "--group", "test"),
                  ("--package", "chunked-loss", "--group", "bench")):  # fmt: skip
        text = subprocess.run([*export, *scope], check=True, capture_output=True, text=True)
        kept, why = wheelhouse_requirements(text.stdout, args.python, have, set(args.without))
        for pin in kept:  # one version of each: the first scope's (the trainer's resolution)
            pins.setdefault(pin.split("==")[0], pin)
        left.update(why)
    platforms = [f"--platform={p}" for p in WHEEL_PLATFORMS]
    no_wheel = []
    for pin in pins.values():
        done = subprocess.run(
            ["uv", "run", "--no-project", "--with", "pip", "python", "-m", "pip", "download",
             "--quiet", "--no-deps", "--only-binary=:all:", "--implementation=cp",
             f"--python-version={args.python}", *platforms, "-d", str(args.dir), pin],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode:
            no_wheel.append(pin)
    size = sum(f.stat().st_size for f in args.dir.glob("*.whl")) / 2**20
    for why in sorted(set(left.values())):
        names = sorted(n for n, w in left.items() if w == why)
        session.log(f"left out, {why}: {len(names)} ({', '.join(names)})")
    if no_wheel:
        session.warn(
            f"no wheel for CPython {args.python} on Linux x86-64, so not in {args.dir} (their GPU "
            f"tests skip there): {', '.join(no_wheel)}"
        )
    session.log(f"{args.dir}: {len(list(args.dir.glob('*.whl')))} wheels, {size:.1f} MiB")
