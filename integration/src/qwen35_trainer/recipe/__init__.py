"""The recipe stage: YAML files that say what to train, read into frozen dataclasses
(:mod:`.schema`; reading, bases and overrides: :mod:`.files`; a checkpoint directory's
``config.json``: :mod:`.model_path`).

A recipe has four sections: ``model`` (the transformers config of the Qwen3.5 MoE-VLM),
``data``, ``train`` and ``parallel``. A recipe may name a ``base`` recipe (a path relative to its
own file); it is read first and the derived recipe's mappings are merged into it key by key
(lists and scalars replace), so variants state only what differs. ``--set section.key=value``
overrides apply last, with the value parsed as YAML.

Nothing is dropped silently: an unknown section or key, a value of the wrong type, or a
``model.text`` / ``model.vision`` key that the transformers config does not have raises
``ValueError`` naming the key and what is allowed.
"""

from qwen35_trainer.recipe.files import (
    BUILTIN_RECIPES,
    builtin_recipes,
    load_recipe,
    recipe_from_dict,
    recipe_path,
)
from qwen35_trainer.recipe.model_schema import LORA_TARGETS, LoRARecipe, ModelRecipe
from qwen35_trainer.recipe.schema import DataRecipe, ParallelRecipe, Recipe, TrainRecipe

__all__ = [
    "BUILTIN_RECIPES",
    "LORA_TARGETS",
    "DataRecipe",
    "LoRARecipe",
    "ModelRecipe",
    "ParallelRecipe",
    "Recipe",
    "TrainRecipe",
    "builtin_recipes",
    "load_recipe",
    "recipe_from_dict",
    "recipe_path",
]
