"""Step time with ``train.compile`` (each decoder and vision block ``torch.compile``-d) against
eager, in ONE run of this script: the same recipe, data and seed, one process, CPU fp32.

The compiled run's first steps compile (dynamic shapes: the packed rows' length changes every
step, so the second step compiles once more); the table prints that cost apart from the
steady-state step time (median of the steps after ``--warmup``). Inductor caches its kernels on
disk (``/tmp/torchinductor_$USER``), so a second run of this script compiles faster. The peer:
torchtitan compiles per block the same way; its models are not this one, so the baseline here is
the same trainer eager.

    python benchmarks/bench_compile.py            # 8 steps, the first 3 excluded
    python benchmarks/bench_compile.py --steps 12
"""

from __future__ import annotations

import argparse
import statistics


def _run(compiled: bool, steps: int) -> list[float]:
    from qwen35_trainer import load_recipe, train

    recipe = load_recipe(
        "tiny",
        [
            "parallel.dp=1",
            "parallel.cp=1",
            "parallel.ep=1",
            "data.path=null",
            "data.processor=null",
            "data.eval_path=null",
            "data.pack_length=null",
            "data.packing=true",
            "data.samples_per_rank=8",
            "data.text_tokens=[64, 96]",
            "model.expert_backend=torch",
            f"train.steps={steps}",
            "train.eval_every=0",
            f"train.compile={str(compiled).lower()}",
        ],
    )
    return [log.seconds for log in train(recipe).logs]


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    eager = _run(False, args.steps)
    compiled = _run(True, args.steps)
    e, c = (statistics.median(t[args.warmup :]) for t in (eager, compiled))
    print(f"{'':>10} {'first steps (s)':>24} {'step (s, median)':>17}")
    for name, times, med in (("eager", eager, e), ("compiled", compiled, c)):
        first = " ".join(f"{t:.2f}" for t in times[: args.warmup])
        print(f"{name:>10} {first:>24} {med:17.3f}")
    print(f"compiled / eager step time: {c / e:.2f}x")


if __name__ == "__main__":
    main()
