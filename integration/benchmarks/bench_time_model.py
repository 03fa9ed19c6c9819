"""The measured step-time model (``qwen35-train plan --measure`` / ``--profile``) against this
trainer's own runs, in one run: per recipe, ONE profile measured here (the one-process plan's
shapes, :func:`qwen35_trainer.plan.measure.measure_profile`, with CP's, EP's and TP's own costs
at degree 2), then for each layout the step the
model predicts with it and the median step of a real CLI run (``step_seconds`` of steps
``WARM + 1`` .. ``STEPS``: the first steps compile and warm up), printed as predicted /
measured / ratio. Goal: every row within ±15 %.

Recipes: ``tiny`` (the demo dataset, a step of ~0.3 s here) and a larger CPU recipe (``tiny``
widened to hidden 512, rows of 1,024 tokens, 8 samples per rank: a step of ~4.5 s in one
process here). Layouts: one process, with
activation checkpointing, DP 2, CP 2 · EP 2, TP 2 + SP, PP 2 (1F1B), PP 2 interleaved zero bubble,
PP 2 × DP 2 (the PP rows with 2 micro-batches).

Then the memory of the same layouts (``--what memory``), each fed the rows its plan counts
exactly (:func:`planned_rows`: the synthetic stream, full rows at the recipe's largest image
grid): each planned rank's counted peak
(:attr:`qwen35_trainer.plan.memory.Memory.peak`, the tensors the planner counts) against the
peak one step of that layout really allocates on that rank
(:func:`qwen35_trainer.plan.memory_probe.rank_peaks`: the ranks side by side, the trainer's own
step, its tensors' peak read from the allocator), printed for the rank whose ratio is furthest
from 1. Goal: every row within ±10 %.

    python benchmarks/bench_time_model.py [--recipes NAME ...] [--rows NAME ...]
        [--what time memory]

On a machine with one GPU (``tools/gpu_checks.py``): ``--recipes tiny 35b-shaped --rows "one
process" "one process, AC"``, the rows one device runs (the CLI trains on CUDA where present);
``35b-shaped`` is Qwen3.5-35B-A3B's widths on one GPU (:data:`RECIPES`), for CUDA only. On an
H100, H200 or B200 each row also prints the datasheet's prediction (no profile: each op class
at its kernel's published rate) over the measured step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from qwen35_trainer.plan import plan
from qwen35_trainer.plan.hardware import GPUS, hardware
from qwen35_trainer.plan.measure import measure_profile
from qwen35_trainer.plan.memory_probe import rank_peaks
from qwen35_trainer.plan.profile import LAYOUT_DIMENSIONS
from qwen35_trainer.plan.timing import step_time
from qwen35_trainer.recipe import load_recipe

STEPS, WARM = 10, 3
ONE = ("parallel.dp=1", "parallel.cp=1", "parallel.ep=1", "parallel.tp=1")
# name: (the recipe it starts from, what it changes)
RECIPES = {
    "tiny": ("tiny", ()),
    "tiny-512": (
        "tiny",
        (
            "model.text.hidden_size=512",
            "model.text.moe_intermediate_size=512",
            "model.text.shared_expert_intermediate_size=512",
            "model.vision.out_hidden_size=512",
            "data.pack_length=1024",
            "data.samples_per_rank=8",
        ),
    ),
    # Qwen3.5-35B-A3B's widths on one GPU (``--recipes 35b-shaped``, CUDA only): its hidden
    # size, heads, expert and shared-expert widths and vocabulary, one 4,096-token row, each
    # expert's share of the routed rows as in the model (top 2 of 64 = top 8 of 256: 1/32),
    # 4 layers (3 Gated DeltaNet + 1 full attention, the model's period), a 2-block tower, no
    # MTP: ~2.0 B parameters, planned at 57.0 GiB of an 80 GiB H100 (58.0 with recompute)
    "35b-shaped": (
        "qwen3_5_35b_a3b",
        (
            "model.text.num_hidden_layers=4",
            "model.text.num_experts=64",
            "model.text.num_experts_per_tok=2",
            "model.mtp_layers=0",
            "model.vision.depth=2",
            "data.pack_length=4096",
            "data.global_batch=1",
            "data.samples_per_rank=1",
            "data.image_grids=[[1, 28, 28]]",
            "train.warmup_steps=1",
            "train.activation_checkpointing=false",  # the "AC" rows turn it on
        ),
    ),
}
GPU_ONLY = ("35b-shaped",)  # too large for a CPU's memory and time
PP = ("parallel.pp=2", "train.grad_accum_steps=2")
LAYOUTS = {
    "one process": ONE,
    "one process, AC": (*ONE, "train.activation_checkpointing=true"),
    "DP 2": (*ONE, "parallel.dp=2"),
    "CP 2 x EP 2": (*ONE, "parallel.cp=2", "parallel.ep=2"),
    "TP 2 + SP": (*ONE, "parallel.tp=2"),
    "PP 2 (1F1B)": (*ONE, *PP),
    "PP 2 interleaved ZB": (
        *ONE,
        *PP,
        "parallel.pp_schedule=interleaved_zb",
        "parallel.pp_virtual_stages=2",
    ),
    "PP 2 x DP 2": (*ONE, *PP, "parallel.dp=2"),
}
COMMON = (f"train.steps={STEPS}", "train.eval_every=0", "train.checkpoint_every=0")


def measured_step(recipe: str, sets: tuple[str, ...], world: int) -> float:
    """The median ``step_seconds`` of steps after :data:`WARM` of a real CLI run."""
    with tempfile.TemporaryDirectory(prefix="time-model-") as folder:
        args = [a for s in (*sets, *COMMON, f"train.output_dir={folder}") for a in ("--set", s)]
        cmd = [sys.executable, "-m", "qwen35_trainer.cli", recipe, "--nproc", str(world), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        rows = [json.loads(line) for line in Path(folder, "metrics.jsonl").read_text().splitlines()]
        seconds = [r["step_seconds"] for r in rows if "step" in r and r["step"] > WARM]
    return statistics.median(seconds)


def planned_rows(recipe) -> tuple[str, ...]:
    """Sets that feed ``recipe`` the rows its plan counts exactly: the synthetic stream, every
    image of the recipe's largest grid, each micro-batch's samples filling its packed row
    (a dataset's rows vary: the planner counts the densest micro-batch of its first rows,
    :mod:`qwen35_trainer.plan.dataset_media`)."""
    data, vision = recipe.data, recipe.model.vision
    grid = max(data.image_grids, key=lambda g: g[0] * g[1] * g[2])
    image = grid[0] * grid[1] * grid[2] // vision.get("spatial_merge_size", 2) ** 2 + 2
    per_sample = data.pack_length // (data.samples_per_rank // recipe.train.grad_accum_steps)
    text = (per_sample - data.images_per_sample * image) // (data.images_per_sample + 1)
    return (
        "data.path=null",
        "data.processor=null",
        "data.eval_path=null",
        f"data.image_grids=[{list(grid)}]",
        f"data.text_tokens=[{text}, {text}]",
    )


def memory_rows(names: list[str], rows: list[str]) -> None:
    """Per recipe and layout, fed the rows its plan counts (:func:`planned_rows`): the counted
    peak and the measured one of the planned rank furthest from its measurement (MiB)."""
    print(f"{'recipe':<9} {'layout':<21} {'rank':>4} {'counted':>8} {'measured':>9} {'ratio':>6}")
    for name in names:
        for row in rows:
            start, sets = RECIPES[name]
            recipe = load_recipe(start, [*sets, *LAYOUTS[row], *COMMON], hub_weights=False)
            recipe = load_recipe(
                start, [*sets, *LAYOUTS[row], *COMMON, *planned_rows(recipe)], hub_weights=False
            )
            planned = plan(recipe, name=name)
            peaks = rank_peaks(recipe, planned.world)
            ratios = {r: m.peak / peaks[r].allocated for r, m in planned.ranks.items()}
            rank = max(ratios, key=lambda r: abs(ratios[r] - 1))
            counted, measured = planned.ranks[rank].peak / 2**20, peaks[rank].allocated / 2**20
            print(
                f"{name:<9} {row:<21} {rank:>4} {counted:8.1f} {measured:9.1f} {ratios[rank]:6.2f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    cpu = [name for name in RECIPES if name not in GPU_ONLY]
    parser.add_argument("--recipes", nargs="*", default=cpu, choices=list(RECIPES))
    parser.add_argument("--what", nargs="*", default=["time", "memory"], choices=["time", "memory"])
    args = parser.parse_args()
    gpu_only = [name for name in args.recipes if name in GPU_ONLY]
    if gpu_only:
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--recipes {' '.join(gpu_only)}: needs a CUDA GPU (none is visible)")
    if "time" in args.what:
        time_rows(args.recipes, args.rows)
    if "memory" in args.what:
        memory_rows(args.recipes, args.rows)


def datasheet_gpu() -> str | None:
    """The :data:`qwen35_trainer.plan.hardware.GPUS` key of the local CUDA GPU, if it is one."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0).lower()
    return next((key for key in GPUS if key in name), None)


def time_rows(names: list[str], layouts: list[str]) -> None:
    """Per recipe: one profile, then each layout's predicted and measured step (seconds); on a
    GPU of the datasheet's (:func:`datasheet_gpu`) also its datasheet prediction (the kernels
    at their published rates, :mod:`qwen35_trainer.plan.kernel_rates`) over the measured step."""
    gpu = datasheet_gpu()
    sheet = f" {'datasheet':>9} {'ratio':>6}" if gpu else ""
    print(f"{'recipe':<9} {'layout':<21} {'predicted':>10} {'measured':>9} {'ratio':>6}{sheet}")
    for name in names:
        start, widen = RECIPES[name]
        rows = {row: (*widen, *LAYOUTS[row]) for row in layouts}
        recipes = {
            row: load_recipe(start, [*sets, *COMMON], hub_weights=False)
            for row, sets in rows.items()
        }
        dims = [
            d
            for d in LAYOUT_DIMENSIONS
            if any(getattr(r.parallel, d) > 1 for r in recipes.values())
        ]
        base = load_recipe(start, [*widen, *ONE, *COMMON], hub_weights=False)
        profile = measure_profile(base, plan(base, name=name), name, dims=dims)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            profile.save(f.name)
        print(f"# {name}: profile {f.name}", flush=True)
        for row, sets in rows.items():
            planned = plan(recipes[row], name=name)
            predicted = step_time(planned, hardware(), profile=profile).seconds
            measured = measured_step(start, sets, planned.world)
            line = (
                f"{name:<9} {row:<21} {predicted:10.3f} {measured:9.3f} {predicted / measured:6.2f}"
            )
            if gpu:
                datasheet = step_time(planned, hardware(gpu)).seconds
                line += f" {datasheet:9.3f} {datasheet / measured:6.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
