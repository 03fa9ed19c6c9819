"""Sessions: ``tests`` (one per package, each in its own environment), ``lint`` and ``bench``.

Each ``tests`` environment is built with ``uv sync --package <name> --group test`` from the
committed lock, so it holds ONLY that package, its own dependencies and its test group: a
package that forgets to declare a dependency fails here, not on a user's machine.
"""

from __future__ import annotations

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
    "fsdp-compat": [("megatron-fsdp==0.5.1", "tests/test_megatron_adapter.py")],
}

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


def _test_env() -> dict[str, str]:
    # One inductor cache shared by all sessions: the first torch.compile costs ~15 s on CPU.
    return {"TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".inductor-cache"), "OMP_NUM_THREADS": "1"}


@nox.session
@nox.parametrize("package", list(MEMBERS))
def tests(session: nox.Session, package: str) -> None:
    """Run one package's suite in an environment that holds only that package."""
    _sync(session, package)
    session.chdir(MEMBERS[package])
    session.run("pytest", "tests", *session.posargs, env=_test_env())
    for requirement, tests_path in ALSO_AGAINST.get(package, []):
        session.run_install(
            "uv",
            "pip",
            "install",
            "--python",
            session.virtualenv.location,
            requirement,
            external=True,
        )
        session.run("pytest", tests_path, *session.posargs, env=_test_env())


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
