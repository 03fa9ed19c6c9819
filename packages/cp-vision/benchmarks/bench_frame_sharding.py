"""Frame sharding vs replicated vision tower at CP = 4: per-rank work and balance.

Two tables from one run:

1. Analytic block FLOPs per rank for the Qwen3.5 vision tower (hidden 1152, intermediate 4304,
   depth 27, patch 16): ``4·d·depth·p·(p + 2d + I)`` per frame of ``p`` patches, summed over each
   rank's frames as ``plan_frames`` cuts them; replicated = every rank encodes everything.
2. Measured CPU time per rank (``time.process_time``, forward + backward) on 4 gloo ranks with a
   small real transformers Qwen3.5 vision tower, sharded (``run_vision_sharded``) vs replicated.

Target: max per-rank work <= 1.1 × replicated / CP whenever there are >= 4·CP units.

Run: ``OMP_NUM_THREADS=1 python benchmarks/bench_frame_sharding.py`` (a few minutes on 2 CPUs).
"""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

from cp_vision import DEFAULT_COST_ALPHA, plan_frames, run_vision_sharded
from dist_testkit import run_ranks

CP = 4
QWEN_HIDDEN, QWEN_DEPTH = 1152, 27
TINY_HIDDEN, TINY_INTERMEDIATE = 128, 512
TINY_ALPHA = 2 * TINY_HIDDEN + TINY_INTERMEDIATE


def qwen_batches() -> dict[str, list[tuple[int, int, int]]]:
    """Patch grids (16-px patches) of realistic batches; every side a multiple of merge 2."""
    rng = random.Random(0)
    images = [(1, 2 * rng.randint(7, 28), 2 * rng.randint(7, 28)) for _ in range(64)]
    mix = [(1, 2 * rng.randint(7, 28), 2 * rng.randint(7, 28)) for _ in range(12)]
    mix[3:3] = [(24, 28, 40)]
    mix[9:9] = [(16, 16, 28)]
    return {
        "(a) 64 images": images,
        "(b) one video, 128 frames": [(128, 28, 40)],
        "(c) 12 images + 2 videos": mix,
        "6 large images (< 4·CP units)": [
            (1, 56, 56),
            (1, 28, 28),
            (1, 40, 56),
            (1, 14, 14),
            (1, 56, 28),
            (1, 20, 20),
        ],
    }


def tiny_batches() -> dict[str, list[tuple[int, int, int]]]:
    """Same shapes scaled down for the CPU tower (2-px patches)."""
    rng = random.Random(1)
    return {
        "(a) 32 images": [(1, 2 * rng.randint(3, 12), 2 * rng.randint(3, 12)) for _ in range(32)],
        "(b) one video, 32 frames": [(32, 16, 24)],
        "(c) 8 images + 2 videos": [
            *[(1, 2 * rng.randint(3, 12), 2 * rng.randint(3, 12)) for _ in range(8)],
            (12, 16, 24),
            (8, 12, 16),
        ],
    }


def analytic_table() -> list[str]:
    per_cost = 4 * QWEN_HIDDEN * QWEN_DEPTH  # FLOPs per unit of p·(p + α)
    lines = [
        "| batch (Qwen3.5 tower, CP=4) | units | replicated TFLOP/rank | sharded max TFLOP/rank "
        "| max / (replicated/CP) | imbalance max/mean |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, grid in qwen_batches().items():
        plan = plan_frames(grid, CP, cost_alpha=DEFAULT_COST_ALPHA)
        replicated = plan.replicated_cost * per_cost / 1e12
        sharded = max(plan.rank_costs) * per_cost / 1e12
        lines.append(
            f"| {name} | {plan.num_units} | {replicated:.2f} | {sharded:.2f} "
            f"| {sharded / (replicated / CP):.3f} | {plan.imbalance:.3f} |"
        )
    return lines


def _make_tower():
    from transformers.models.qwen3_5_moe import Qwen3_5MoeVisionConfig, Qwen3_5MoeVisionModel

    torch.manual_seed(0)
    config = Qwen3_5MoeVisionConfig(
        depth=2, hidden_size=TINY_HIDDEN, intermediate_size=TINY_INTERMEDIATE, num_heads=4,
        patch_size=2, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
        num_position_embeddings=64,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return Qwen3_5MoeVisionModel(config).float()


def _rank_timings(grid: list[tuple[int, int, int]], repeats: int) -> dict[str, float]:
    """On one rank: CPU seconds per step (forward + backward), replicated and sharded."""
    tower = _make_tower()

    def vision_fn(pv, g):
        return tower(pv, g).pooler_output

    grid_thw = torch.tensor(grid)
    pixels = torch.randn(int((grid_thw.prod(1)).sum()), 3 * 2 * 2 * 2)
    plan = plan_frames(grid_thw, CP, cost_alpha=TINY_ALPHA)

    def replicated():
        vision_fn(pixels, grid_thw).sum().backward()

    def sharded():
        run_vision_sharded(
            vision_fn, pixels, grid_thw, None, trainable=True, plan=plan
        ).sum().backward()

    out = {}
    for name, step in (("replicated", replicated), ("sharded", sharded)):
        step()  # warm-up
        dist.barrier()
        start = time.process_time()
        for _ in range(repeats):
            step()
        out[name] = (time.process_time() - start) / repeats
    return out


def measured_table(repeats: int = 3) -> list[str]:
    lines = [
        "| batch (tiny tower, 4 gloo ranks) | units | replicated CPU s/rank | sharded max CPU s/rank "
        "| max / (replicated/CP) | measured imbalance max/mean | planned imbalance |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, grid in tiny_batches().items():
        per_rank = run_ranks(_rank_timings, CP, grid, repeats, timeout=600)
        rep = sum(r["replicated"] for r in per_rank) / CP
        shard = [r["sharded"] for r in per_rank]
        plan = plan_frames(grid, CP, cost_alpha=TINY_ALPHA)
        lines.append(
            f"| {name} | {plan.num_units} | {rep:.4f} | {max(shard):.4f} "
            f"| {max(shard) / (rep / CP):.3f} | {max(shard) * CP / sum(shard):.3f} | {plan.imbalance:.3f} |"
        )
    return lines


if __name__ == "__main__":
    print("\n".join(analytic_table()))
    print()
    print("\n".join(measured_table()))
