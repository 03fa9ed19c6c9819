"""How many 80 GiB GPUs each public size fine-tunes on: the built-in recipes of the three
sizes, full fine-tuning and LoRA on a bf16 or an FP8 base, each planned (:func:`plan`), timed on
the H100 (:func:`.timing.step_time`) and set out as one markdown table (``qwen35-train plan
--sizes``; the README's table)."""

from __future__ import annotations

from collections.abc import Callable

from qwen35_trainer.plan.hardware import hardware
from qwen35_trainer.plan.planner import Plan, plan
from qwen35_trainer.plan.timing import step_time
from qwen35_trainer.recipe import load_recipe

__all__ = ["SIZES", "size_table"]

# model -> its recipes: full fine-tuning, LoRA with the base in bf16, LoRA with the base in FP8
SIZES = {
    "Qwen3.5-35B-A3B": ("qwen3_5_35b_a3b", "qwen3_5_35b_a3b_lora", "qwen3_5_35b_a3b_lora_fp8"),
    "Qwen3.5-122B-A10B": (
        "qwen3_5_122b_a10b_128k",
        "qwen3_5_122b_a10b_lora",
        "qwen3_5_122b_a10b_lora_fp8",
    ),
    "Qwen3.5-397B-A17B": (
        "qwen3_5_397b_a17b",
        "qwen3_5_397b_a17b_lora",
        "qwen3_5_397b_a17b_lora_fp8",
    ),
}
COLUMNS = ("full fine-tuning", "LoRA, bf16 base", "LoRA, FP8 base")


def _cell(name: str, planned: Plan, pack_length: int) -> str:
    layout = " × ".join(f"{k.upper()} {v}" for k, v in planned.layout.items() if v > 1)
    gpus = f"{planned.world} GPU{'s' if planned.world > 1 else ''}"
    tokens = step_time(planned, hardware("h100")).tokens_per_gpu
    return (
        f"{gpus}{', ' + layout if layout else ''}, {pack_length // 1024}K rows: "
        f"{planned.peak_gib:.1f} GiB, {tokens:,.0f} tokens/s/GPU (`{name}`)"
    )


def size_table(planner: Callable[..., Plan] | None = None) -> str:
    """The table (module docstring): one row per size, one column per way to fine-tune, each
    cell the recipe's GPUs, layout, rows, predicted peak per GPU and tokens/s/GPU on the H100
    (``planner``: :func:`plan` unless given)."""
    planner = planner or plan
    lines = [f"| model | {' | '.join(COLUMNS)} |", "|---" * (len(COLUMNS) + 1) + "|"]
    for model, names in SIZES.items():
        cells = []
        for name in names:
            recipe = load_recipe(name)
            cells.append(_cell(name, planner(recipe, name=name), recipe.data.pack_length))
        lines.append(f"| {model} | {' | '.join(cells)} |")
    return "\n".join(lines)
