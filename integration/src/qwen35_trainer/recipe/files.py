"""Recipe files: YAML read into the schema (:mod:`.schema`), with ``base:`` derivation, ``--set``
overrides, YAML 1.1 number strings read as numbers, the built-in recipes by name, the input
paths made absolute (:data:`INPUT_PATHS`: relative to the recipe file that states them; a
Hugging Face Hub id with no local path of its name kept as written), ``builtin:demo/...`` paths
made the demo dataset's files (written on first use), the Hub ids resolved to their snapshots
(:mod:`.hub`), and ``model.path``'s ``config.json`` applied (:mod:`.model_path`). Each happens
once, when the recipe is built: every reader of a built recipe reads a local path."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from qwen35_trainer.demo.dataset import resolve
from qwen35_trainer.recipe.hub import hub_shaped, with_hub_snapshots
from qwen35_trainer.recipe.model_path import with_checkpoint_config
from qwen35_trainer.recipe.schema import Recipe

__all__ = ["BUILTIN_RECIPES", "builtin_recipes", "load_recipe", "recipe_from_dict", "recipe_path"]


# The paths a recipe reads from: relative ones are relative to the recipe file that states them
# (a command-line override's to the working directory); the run's outputs (train.output_dir,
# checkpoint_dir, export_dir) are relative to the working directory.
INPUT_PATHS = {
    "model": ("path", "weights", "lora.init_from"),
    "data": ("path", "eval_path", "processor"),
}
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_SECTIONS = {f.name: f.type for f in dataclasses.fields(Recipe)}


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _anchored(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``data`` with the relative paths it reads from (:data:`INPUT_PATHS`) made absolute
    against ``folder`` (``~`` expanded; ``builtin:`` paths and absolute ones unchanged, and a
    Hub id, ``org/name``, when ``folder`` holds nothing of that name); the base checkpoint as
    written is kept as ``model.base_as_written``."""
    for values, key in _input_values(data):
        value = values[key]
        if isinstance(value, str) and value and not value.startswith("builtin:"):
            local = os.path.normpath(folder / Path(value).expanduser())
            if not hub_shaped(value) or os.path.exists(local):  # a local path wins
                values[key] = local
            if values is data.get("model") and key in ("path", "weights"):
                values.setdefault("base_as_written", value)  # what an adapter export names
    return data


def _input_values(data: dict[str, Any]):
    """``(values, key)`` for each input path :data:`INPUT_PATHS` names that ``data`` holds
    (``values``: the mapping that holds it, nested sections included)."""
    for section, keys in INPUT_PATHS.items():
        for dotted in keys:
            *parents, key = dotted.split(".")
            values = data.get(section)
            for parent in parents:  # a nested section (model.lora)
                values = values.get(parent) if isinstance(values, dict) else None
            if isinstance(values, dict) and key in values:
                yield values, key


def _with_builtin_paths(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with each ``builtin:demo/REST`` input the demo folder's ``REST`` (the folder
    written first if missing: :func:`qwen35_trainer.demo.dataset.ensure_demo`)."""
    data = copy.deepcopy(data)  # the caller's mapping stays as given
    for values, key in _input_values(data):
        value = values[key]
        if not isinstance(value, str) or not value.startswith("builtin:"):
            continue
        try:
            values[key] = resolve(value)
        except ValueError as err:
            raise ValueError(f"{key}: {err}") from None
    return data


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ValueError(f"recipe base cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
    data = _anchored(data, path.parent)
    base = data.pop("base", None)
    if base is None:
        return data
    return _merge(_read(_base_file(path, base), (*seen, path)), data)


def _base_file(path: Path, base: Any) -> Path:
    """The file recipe ``path``'s ``base:`` names: a file beside it (or at that path), else a
    built-in recipe of that name (``tiny``, ``qwen3_5_35b_a3b``, ``base`` ...); ``ValueError``
    naming both possibilities otherwise."""
    if not isinstance(base, str) or not base:
        raise ValueError(f"{path}: base must be a recipe file or a built-in recipe's name")
    beside = path.parent / Path(base).expanduser()
    if beside.is_file():
        return beside
    builtin = BUILTIN_RECIPES / f"{base.removesuffix('.yaml')}.yaml"
    if "/" not in base and builtin.is_file():  # a bare name: tiny, base.yaml, ...
        return builtin
    raise ValueError(
        f"{path}: base {base!r} is neither a file ({beside}) nor a built-in recipe (built-in: "
        f"{', '.join(['base', *builtin_recipes()])})"
    )


def _override(data: dict[str, Any], item: str) -> dict[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"an override is section.key=value, got {item!r}")
    *parents, leaf = key.split(".")
    nested: Any = yaml.safe_load(raw)
    nested = {leaf: nested}
    for parent in reversed(parents):
        nested = {parent: nested}
    return _merge(data, _anchored(nested, Path.cwd()))


def _coerce(where: str, hint: Any, value: Any) -> Any:
    """``value`` checked against the annotation ``hint`` (YAML lists become tuples)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        kinds = [option for option in options if option is not type(None)]
        if len(kinds) == 1:  # ``X | None``: X's own message
            return _coerce(where, kinds[0], value)
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(where, option, value)
            except ValueError:
                continue
        raise ValueError(f"{where}: expected {hint}, got {value!r}")
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(f"{where}[{i}]", args[0], v) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ValueError(f"{where}: expected {len(args)} items, got {value!r}")
        return tuple(
            _coerce(f"{where}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if dataclasses.is_dataclass(hint):  # a nested section (model.lora)
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return _section(where, hint, value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
    if hint in (bool, int, float, str) and (type(value) is not hint):
        raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def _section(name: str, cls: type, values: Any) -> Any:
    if not isinstance(values, Mapping):
        raise ValueError(f"recipe section {name!r} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ValueError(
            f"unknown recipe key(s) {[f'{name}.{k}' for k in unknown]}; {name} has {sorted(hints)}"
        )
    kwargs = {k: _coerce(f"{name}.{k}", hints[k], v) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"recipe section {name!r}: {err}") from err


def recipe_from_dict(data: Mapping[str, Any], *, hub_weights: bool = True) -> Recipe:
    """A :class:`Recipe` from a mapping of sections (what a YAML recipe holds); its built-in
    paths made the demo's files, its Hub ids resolved to snapshots (:mod:`.hub`;
    ``hub_weights``: with a model's safetensors)."""
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ValueError(f"unknown recipe section(s) {unknown}; known: {sorted(_SECTIONS)}")
    if "model" not in data:
        raise ValueError("a recipe needs a 'model' section")
    data = _with_builtin_paths(dict(data))
    data = with_checkpoint_config(with_hub_snapshots(data, weights=hub_weights))
    hints = typing.get_type_hints(Recipe)
    return Recipe(**{name: _section(name, hints[name], data[name]) for name in data})


def _builtin_recipes_dir() -> Path:
    """The built-in recipes: inside an installed wheel ``qwen35_trainer/recipes`` (the
    repository's top-level ``recipes/`` folder, included by the build's hook,
    ``integration/hatch_build.py``), else that folder of the repository (a workspace or
    editable install)."""
    packaged = Path(__file__).parents[1] / "recipes"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[4] / "recipes"


BUILTIN_RECIPES = _builtin_recipes_dir()


def builtin_recipes() -> list[str]:
    """Names of the recipes shipped with the package (``qwen35-train NAME``); ``base.yaml``
    and the ``_*.yaml`` files, settings recipes share, are not recipes of their own."""
    return sorted(
        p.stem
        for p in BUILTIN_RECIPES.glob("*.yaml")
        if p.stem != "base" and not p.stem.startswith("_")
    )


def recipe_path(name_or_path: str | Path) -> Path:
    """A recipe file: ``name_or_path`` itself when it exists, else the built-in recipe of that
    name; ``ValueError`` naming both possibilities otherwise."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    builtin = BUILTIN_RECIPES / f"{name_or_path}.yaml"
    if path.suffix == "" and builtin.is_file():
        return builtin
    raise ValueError(
        f"no recipe file {str(path)!r} and no built-in recipe of that name (built-in: "
        f"{', '.join(builtin_recipes())})"
    )


def load_recipe(
    path: str | Path, overrides: Iterable[str] = (), *, hub_weights: bool = True
) -> Recipe:
    """Read a YAML recipe (a path, or a built-in recipe's name; following ``base``), apply
    ``section.key=value`` overrides; ``hub_weights=False`` leaves a Hub model's safetensors
    unfetched (the planner reads ``config.json`` only)."""
    data = _read(recipe_path(path))
    for item in overrides:
        data = _override(data, item)
    return recipe_from_dict(data, hub_weights=hub_weights)
