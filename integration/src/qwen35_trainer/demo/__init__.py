"""The built-in demo dataset (``builtin:demo/...`` paths): conversations about small images and
videos, and a processor directory trained on their text (:mod:`.dataset`, :mod:`.processor`).

It imports nothing of the trainer, so the recipe stage resolves ``builtin:`` paths to its
files when a recipe is built (:mod:`qwen35_trainer.recipe.files`) and every later reader sees
a local path.
"""
