"""Every stage's public names exist: each module of ``qwen35_trainer`` imports on its own (no
hidden import cycle), and every name in its ``__all__`` is there. The stages import one way:
recipe → parallel → data → model → supervise → train / plan → cli (no module imports a later
stage)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import qwen35_trainer

PACKAGE = Path(qwen35_trainer.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], "qwen35_trainer."))
# A module may import its own stage and the stages before it.
# cli_common: the exit codes and recipe arguments every command shares (imports nothing);
# supervise: how a run is launched, stopped and recorded, which the train loop calls;
# cli_info: the informational commands (--version, show); demo: the built-in demo dataset (imports
# nothing of the trainer: the recipe resolves builtin: paths to its files)
ORDER = [
    "cli_common",
    "demo",
    "recipe",
    "parallel",
    "data",
    "model",
    "supervise",
    "train",
    "plan",
    "cli_info",
    "cli",
]


def _stage(module: str) -> str:
    return module.split(".")[1]


@pytest.mark.parametrize("name", ["qwen35_trainer", *MODULES])
def test_every_public_name_imports(name):
    module = importlib.import_module(name)
    missing = [n for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it lacks: {missing}"


def test_stages_import_one_way():
    backwards = []
    for name in MODULES:
        path = PACKAGE.joinpath(*name.split(".")[1:])
        file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qwen35_"):
                target = node.module.split(".")
                if target[0] != "qwen35_trainer" or len(target) < 2:
                    continue
                if ORDER.index(target[1]) > ORDER.index(_stage(name)):
                    backwards.append(f"{name} imports {node.module}")
    assert not backwards, backwards
