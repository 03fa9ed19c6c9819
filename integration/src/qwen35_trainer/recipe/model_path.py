"""``model.path``: a transformers checkpoint directory as the source of truth for the model.

Its ``config.json`` gives the text and vision configs, the token ids and, for an FP8
checkpoint, its ``quantization_config`` (``model.quantization``); its safetensors are
the weights; its processor files are the data's (``data.processor`` defaults to it). This module
fills a recipe's ``model`` section from ``config.json`` before the recipe is built, so every
stage (model, planner, synthetic stream, data) reads one set of numbers:

- a key the recipe states in ``model.text`` / ``model.vision`` / the token ids must equal
  ``config.json``'s value (a mapping value: the keys it states), else ONE ``ValueError`` lists
  every disagreement with both values;
- a deliberate change goes under ``model.override`` (``text`` / ``vision`` mappings, token ids):
  its values replace ``config.json``'s, and since the resolved recipe keeps the section, the run
  folder's ``recipe.yaml`` says what was changed (and loads back to the same recipe: a stated
  value may equal the override's).

Only ``config.json`` is read here (no weights, no transformers import), so ``qwen35-train
plan`` reads a checkpoint's shapes from it in milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TOKEN_IDS", "with_checkpoint_config"]

TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
# config.json bookkeeping that is not a model hyperparameter
_BOOKKEEPING = {
    "model_type",
    "transformers_version",
    "architectures",
    "dtype",
    "torch_dtype",
    "_name_or_path",
}
_SECTIONS = ("text", "vision")


def _read(path: str) -> dict[str, Any]:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(
            f"model.path: {path!r} is not a transformers checkpoint directory (no "
            "config.json there)"
        )
    try:
        config = json.loads(file.read_text())
        text, vision = config["text_config"], config["vision_config"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"model.path: {file} is not a Qwen3.5 MoE-VLM config (expected "
            f"text_config and vision_config): {err}"
        ) from err
    return {
        "text": {k: v for k, v in text.items() if k not in _BOOKKEEPING},
        "vision": {k: v for k, v in vision.items() if k not in _BOOKKEEPING},
        **{k: config.get(k) for k in TOKEN_IDS},
        "quantization": config.get("quantization_config"),
        "stored_dtype": config.get("dtype") or config.get("torch_dtype"),
    }


def _same(stated: Any, disk: Any) -> bool:
    """Equal values; for a mapping, the keys ``stated`` names."""
    if isinstance(stated, dict) and isinstance(disk, dict):
        return all(k in disk and _same(v, disk[k]) for k, v in stated.items())
    return stated == disk


def _override(override: Any, disk: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(override, dict):
        raise ValueError(f"model.override must be a mapping, got {override!r}")
    unknown = sorted(set(override) - {*_SECTIONS, *TOKEN_IDS})
    if unknown:
        raise ValueError(
            f"model.override has unknown key(s) {unknown}; it takes {[*_SECTIONS, *TOKEN_IDS]}"
        )
    for section in _SECTIONS:
        if not isinstance(override.get(section, {}), dict):
            raise ValueError(f"model.override.{section} must be a mapping")
        new = sorted(set(override.get(section, {})) - set(disk[section]))
        unknown = [k for k in new if not hasattr(_default_config(section), k)]
        if unknown:
            raise ValueError(
                f"model.override.{section}: neither config.json nor transformers' "
                f"Qwen3.5 {section} config has {unknown}"
            )
    return override


def _default_config(section: str) -> Any:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
        Qwen3_5MoeTextConfig,
        Qwen3_5MoeVisionConfig,
    )

    return (Qwen3_5MoeTextConfig if section == "text" else Qwen3_5MoeVisionConfig)()


def with_checkpoint_config(data: dict[str, Any]) -> dict[str, Any]:
    """The recipe mapping ``data`` with its ``model`` section filled from ``model.path``'s
    ``config.json`` (checked against what the recipe states, ``model.override`` applied) and
    ``data.processor`` defaulting to ``model.path``; unchanged without ``model.path``."""
    model = data.get("model")
    if not isinstance(model, dict) or not model.get("path"):
        return data
    path = str(model["path"])
    disk = _read(path)
    override = _override(model.get("override") or {}, disk)
    disagree = []
    for section in _SECTIONS:
        stated = model.get(section) or {}
        for key, value in stated.items():
            changed = override.get(section, {})
            if key in changed and _same(value, changed[key]):
                continue
            if key not in disk[section] or not _same(value, disk[section][key]):
                found = disk[section].get(key, "(absent)")
                disagree.append(f"model.{section}.{key}: recipe {value!r}, checkpoint {found!r}")
    for key in TOKEN_IDS:
        if key in model and model[key] != override.get(key, disk[key]):
            disagree.append(f"model.{key}: recipe {model[key]!r}, checkpoint {disk[key]!r}")
    if model.get("quantization") is not None and not _same(
        model["quantization"], disk["quantization"] or {}
    ):
        disagree.append(
            f"model.quantization: recipe {model['quantization']!r}, checkpoint's "
            f"quantization_config {disk['quantization']!r}"
        )
    if model.get("stored_dtype") not in (None, disk["stored_dtype"]):
        disagree.append(
            f"model.stored_dtype: recipe {model['stored_dtype']!r}, checkpoint's dtype "
            f"{disk['stored_dtype']!r}"
        )
    if disagree:
        raise ValueError(
            f"model.path {path}/config.json disagrees with the recipe (state a "
            "deliberate change under model.override): " + "; ".join(disagree)
        )
    resolved = dict(model)
    for section in _SECTIONS:
        resolved[section] = {**disk[section], **override.get(section, {})}
    for key in TOKEN_IDS:
        resolved[key] = override.get(key, disk[key])
    resolved["quantization"] = disk["quantization"]
    resolved["stored_dtype"] = disk["stored_dtype"]
    out = {**data, "model": resolved}
    section = data.get("data")
    dataset = isinstance(section, dict) and (section.get("path") or section.get("source"))
    if dataset and not section.get("processor"):
        out["data"] = {**section, "processor": path}
    return out
