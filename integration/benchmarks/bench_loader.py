"""Loader throughput vs what the tiny recipe's step consumes (one process, the demo dataset).

- loader: :class:`qwen35_trainer.data.loader.DataStream` reading the tiny recipe's 4 packed rows
  of 256 tokens per step through the processor (images, videos from frame files and mp4) with
  0 workers (the naive baseline: every document encoded in the training process, in line),
  1 and 2 worker processes; the first step (worker start-up) is not timed;
- step: the tiny recipe in one process training on the same rows, its compute time per step
  (step time minus the time it waited for data), as the rate the loader has to keep up with.

The ratio loader rate / step rate above 1 means a step never waits for its data once the
workers are ahead (with workers, encoding overlaps the step; without, it adds to it).

    python benchmarks/bench_loader.py            # 30 timed loader steps, 12 training steps
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

ONE_PROCESS = ["parallel.dp=1", "parallel.cp=1", "parallel.ep=1", "train.eval_every=0"]


def _loader_rate(recipe, steps: int) -> dict[str, float]:
    import torch

    from qwen35_trainer.data.loader import DataStream
    from qwen35_trainer.model import build_config
    from qwen35_trainer.parallel import Layout

    stream = DataStream(recipe, build_config(recipe.model), Layout(), torch.device("cpu"))
    stream.next_step()  # workers start, the processor loads
    tokens = images = videos = 0
    began = time.perf_counter()
    for _ in range(steps):
        for row in stream.next_step().rows:
            tokens += sum(len(d) for d in row)
            images += sum(len(d.image_grid_thw) for d in row)
            videos += sum(len(d.video_grid_thw) for d in row)
    seconds = time.perf_counter() - began
    return {"tokens": tokens / seconds, "images": images / seconds, "videos": videos / seconds}


def _step_rate(recipe) -> float:
    from qwen35_trainer import train

    logs = train(recipe).logs[2:]  # past the first steps' allocations
    tokens = [log.fill * recipe.data.pack_length * recipe.data.global_batch for log in logs]
    compute = [log.seconds - log.data_seconds for log in logs]
    return statistics.fmean(tokens) / statistics.fmean(compute)


def main() -> None:
    import torch

    from qwen35_trainer import load_recipe

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed loader steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("QWEN35_DEMO_DIR", os.path.join(tempfile.gettempdir(), "qwen35-demo"))
    need = _step_rate(load_recipe("tiny", [*ONE_PROCESS, "train.steps=12", "data.workers=2"]))
    print(f"tiny recipe step (one process, 4 rows x 256 tokens): consumes {need:,.0f} tokens/s")
    print("| loader workers | tokens/s | images/s | videos/s | loader / step |")
    print("|---:|---:|---:|---:|---:|")
    for workers in (0, 1, 2):
        recipe = load_recipe("tiny", [*ONE_PROCESS, f"data.workers={workers}"])
        rate = _loader_rate(recipe, args.steps)
        print(
            f"| {workers} | {rate['tokens']:,.0f} | {rate['images']:,.1f} | "
            f"{rate['videos']:,.1f} | {rate['tokens'] / need:.1f}x |"
        )


if __name__ == "__main__":
    main()
