"""Ships the repository's top-level ``recipes/`` folder inside the package.

The folder lives beside ``packages/`` and ``integration/`` (the design card's layout), outside
this project's root, so a plain ``force-include`` would not find it when a wheel is built from
the sdist. This hook finds it in either place — ``../recipes`` in the repository, ``recipes/``
inside an unpacked sdist (where the hook put it) — and includes it: as ``recipes/`` in the
sdist, as ``qwen35_trainer/recipes/`` in the wheel. No folder found is an error, never a
wheel without its recipes.
"""

from __future__ import annotations

from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class RecipesHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        root = Path(self.root)
        found = [p for p in (root / "recipes", root.parent / "recipes") if p.is_dir()]
        if not found:
            raise FileNotFoundError(f"no recipes/ folder in {root} or {root.parent}")
        target = "recipes" if self.target_name == "sdist" else "qwen35_trainer/recipes"
        build_data["force_include"][str(found[0])] = target
