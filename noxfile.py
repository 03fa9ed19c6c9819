"""Sessions: ``tests`` (one per package, each in its own environment), ``lint``, ``bench`` and
``gpu`` (everything that needs a CUDA GPU, as one unattended run).

Each ``tests`` environment is built with ``uv sync --package <name> --group test`` from the
committed lock, so it holds ONLY that package, its own dependencies and its test group: a
package that forgets to declare a dependency fails here, not on a user's machine.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
MEMBERS = {name: ROOT / "packages" / name for name in PACKAGES}
MEMBERS["qwen35-trainer"] = ROOT / "integration"

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


def _test_env() -> dict[str, str | None]:
    # One inductor cache shared by all sessions: the first torch.compile costs ~15 s on CPU.
    # A module FSDP2 wraps must not return a view: an error in the ranks and runs tests start
    # too (pytest's own filter, in pyproject.toml, covers only its process).
    # Bytecode is written (PYTHONDONTWRITEBYTECODE unset, where the machine sets it): uv installs
    # no .pyc files, and without them every process of a suite (each rank of every gloo launch,
    # each worker, each CLI run) compiled torch's and transformers' sources again: importing the
    # trainer took 15 s instead of 7.
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".inductor-cache"),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "error:FSDP2-wrapped module:UserWarning",
        "PYTHONDONTWRITEBYTECODE": None,
    }


@nox.session
@nox.parametrize("package", list(MEMBERS))
def tests(session: nox.Session, package: str) -> None:
    """Run one package's suite in an environment that holds only that package."""
    _sync(session, package)
    session.chdir(MEMBERS[package])
    session.run("pytest", "tests", *PYTEST_ARGS.get(package, ()), *session.posargs, env=_test_env())
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
        session.run("pytest", *tests_paths, *session.posargs, env=_test_env())


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
            session.run("python", str(script), *session.posargs, env=_test_env())


def _has_extra(path: Path, extra: str) -> bool:
    with open(path / "pyproject.toml", "rb") as f:
        return extra in tomllib.load(f).get("project", {}).get("optional-dependencies", {})


# GPU benchmarks: (package, script, arguments), sized to finish in about a minute each on one H200.
GPU_BENCHMARKS = [
    ("chunked-loss", "benchmarks/bench_loss.py",
     ["--device", "cuda", "--dtype", "bf16", "--tokens", "8192", "--hidden", "3072",
      "--timeout", "180"]),
]  # fmt: skip


@nox.session
def gpu(session: nox.Session) -> None:
    """Every GPU check as ONE run for a lent device (one H200, about 10 minutes): each package's
    ``@pytest.mark.gpu`` tests with its ``gpu`` extra (TransformerEngine, flash-attn, fla; the
    trainer's ``gpu`` extra brings every package's; its 2-GPU tests skip on one GPU), the
    GPU benchmarks, then a one-GPU bf16 smoke run of the tiny recipe (20 steps, loss must fall).
    Refuses to start without CUDA, so it never reports skipped GPU tests as a pass."""
    if shutil.which("nvidia-smi") is None:
        session.error("nox -s gpu needs a CUDA GPU: nvidia-smi is not on PATH")
    env = {**_test_env(), "OMP_NUM_THREADS": "4"}
    for package, path in MEMBERS.items():
        _sync(session, package, *(("--extra", "gpu") if _has_extra(path, "gpu") else ()))
        session.chdir(path)
        # exit code 5: the package has no GPU test
        session.run("pytest", "tests", "-m", "gpu", "-q", "-rs", env=env, success_codes=[0, 5])
    for package, script, args in GPU_BENCHMARKS:
        path = MEMBERS[package]
        _sync(session, package, *(("--group", "bench") if _has_group(path, "bench") else ()))
        session.chdir(path)
        session.run("python", script, *args, env=env)
    _sync(session, "qwen35-trainer", "--extra", "gpu")
    session.chdir(ROOT)
    session.run("python", "-c", GPU_SMOKE, env=env)


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
