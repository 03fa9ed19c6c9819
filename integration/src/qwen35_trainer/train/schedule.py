"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay to a floor.

``lr_at(step)`` is a pure function of the 0-based optimizer step and the recipe, so a resumed
run recomputes the value of the step it resumes at (a changed ``lr``, schedule or ``steps`` in
the recipe takes effect on resume, rather than the checkpoint's stored learning rate):

- warmup (``step < warmup_steps``): ``lr * (step + 1) / warmup_steps``;
- then with ``p = (step - warmup_steps) / (steps - warmup_steps)`` in [0, 1) and
  ``floor = lr_floor * lr``: constant ``lr``; linear ``floor + (lr - floor) * (1 - p)``; cosine
  ``floor + (lr - floor) * (1 + cos(pi p)) / 2``.
"""

from __future__ import annotations

import logging
import math

__all__ = ["lr_at", "optimizer_name", "set_lr"]

logger = logging.getLogger("qwen35_trainer")


def lr_at(step: int, training) -> float:
    """The learning rate of optimizer step ``step`` (0-based) for a ``train`` recipe section."""
    lr, warmup = training.lr, training.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if training.schedule == "constant":
        return lr
    p = (step - warmup) / max(1, training.steps - warmup)
    floor = training.lr_floor * lr
    if training.schedule == "linear":
        return floor + (lr - floor) * (1 - p)
    return floor + (lr - floor) * (1 + math.cos(math.pi * p)) / 2


def set_lr(optimizer, lr: float) -> None:
    """Set every parameter group's learning rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_name(name: str) -> str:
    """``train.optimizer`` resolved: ``auto`` is TransformerEngine's fused Adam (AdamW-style
    decay, fp32 moments) where TE imports, else torch's AdamW (said once)."""
    if name != "auto":
        return name
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        logger.info("train.optimizer=auto: TransformerEngine is not installed, using adamw")
        return "adamw"
    return "te_fused_adam"
