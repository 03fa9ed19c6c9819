"""``benchmarks/bench_time_model.py``'s GPU recipe: the first lent GPU measures the step-time
model's error at Qwen3.5-35B-A3B's widths in one command (``tools/gpu_checks.py``). What a CPU
can check: the recipe keeps the model's widths and each expert's share of the routed rows, the
planner fits it on one 80 GiB H100 in both rows the GPU script runs, and the bench refuses it
without CUDA in one line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwen35_trainer.plan import plan
from qwen35_trainer.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "integration" / "benchmarks" / "bench_time_model.py"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_script_runs_the_35b_shaped_recipe_which_fits_one_h100():
    bench, checks = _module(BENCH), _module(ROOT / "tools" / "gpu_checks.py")
    (args,) = [a for _, script, a in checks.GPU_BENCHMARKS if script.endswith(BENCH.name)]
    assert "35b-shaped" in args[args.index("--recipes") :]
    rows = args[args.index("--rows") + 1 :]
    start, sets = bench.RECIPES["35b-shaped"]
    full = load_recipe(start, hub_weights=False).model.text
    for row in rows:
        recipe = load_recipe(start, [*sets, *bench.LAYOUTS[row], *bench.COMMON], hub_weights=False)
        text = recipe.model.text
        for width in ("hidden_size", "num_attention_heads", "moe_intermediate_size", "vocab_size"):
            assert text[width] == full[width], width
        share = text["num_experts_per_tok"] / text["num_experts"]
        assert share == full["num_experts_per_tok"] / full["num_experts"]
        assert recipe.train.activation_checkpointing == ("AC" in row)
        planned = plan(recipe, name="35b-shaped")
        assert planned.world == 1 and planned.gpu_memory_gib == 80
        assert planned.fits, (row, planned.peak_gib)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_the_bench_refuses_the_gpu_recipe_without_cuda():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--recipes", "35b-shaped"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--recipes 35b-shaped: needs a CUDA GPU" in done.stderr
    assert "Traceback" not in done.stderr
