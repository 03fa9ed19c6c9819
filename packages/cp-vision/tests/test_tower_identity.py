"""The core identity on a real transformers Qwen3.5 vision tower, in one process.

tower(all frames) equals the concatenation, in rank order, of tower(each rank's frames) as
``plan_frames`` assigns them (dummy ranks' outputs dropped) — forward and parameter gradients.
This is what ``run_vision_sharded`` relies on; the gloo tests add the collectives.
"""

from __future__ import annotations

import pytest
import torch
from tiny_tower import MERGE, PIXEL_WIDTH, make_batch, make_tower, param_grads, vision_fn

from cp_vision import plan_frames
from dist_testkit import assert_close, assert_grads_close

CASES = {
    "images": [(1, 4, 4), (1, 2, 2), (1, 2, 6), (1, 4, 2), (1, 6, 6)],
    "videos": [(4, 2, 2), (3, 4, 2)],
    "mixed": [(1, 4, 4), (3, 2, 4), (1, 2, 2), (2, 6, 2)],
    "one_long_video": [(9, 4, 4)],
    "fewer_frames_than_ranks": [(1, 4, 2), (1, 2, 2)],
    "one_video_fewer_frames": [(2, 4, 4)],
}


def _full_run(tower, pixels, grid, weight_ND):
    tower.zero_grad(set_to_none=True)
    out = vision_fn(tower)(pixels, grid)
    (out * weight_ND).sum().backward()
    return out.detach(), param_grads(tower)


def _per_rank_run(tower, pixels, grid, weight_ND, world):
    plan = plan_frames(grid, world, cost_alpha=2 * 32 + 64, spatial_merge_size=MERGE)
    tower.zero_grad(set_to_none=True)
    outs = []
    for rank in range(world):
        local_grid = torch.tensor(plan.local_grids[rank], dtype=grid.dtype)
        if plan.is_dummy(rank):
            local_pixels = torch.zeros(MERGE * MERGE, PIXEL_WIDTH)
        else:
            start, end = plan.pixel_ranges[rank]
            local_pixels = pixels[start:end]
        local = vision_fn(tower)(local_pixels, local_grid)
        assert local.shape[0] == plan.local_token_count(rank)
        outs.append(local)
    real = [o for r, o in enumerate(outs) if not plan.is_dummy(r)]
    out = torch.cat(real)
    (out * weight_ND).sum().backward()
    return out.detach(), param_grads(tower), plan


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tower_of_all_frames_equals_concat_of_rank_slices(case, world):
    tower = make_tower(depth=2)
    pixels, grid = make_batch(CASES[case])
    n_tokens = sum(t * h * w for t, h, w in CASES[case]) // MERGE**2
    weight_ND = torch.randn(n_tokens, 32, generator=torch.Generator().manual_seed(7))

    ref_out, ref_grads = _full_run(tower, pixels, grid, weight_ND)
    out, grads, plan = _per_rank_run(tower, pixels, grid, weight_ND, world)

    assert ref_out.shape == (plan.num_tokens, 32)
    assert_close(out, ref_out, rtol=1e-5, atol=1e-6, name=f"{case} output")
    # fp32 sums over rows in a different order: atol covers that, a real bug is ~1e-3.
    assert_grads_close(grads, ref_grads, rtol=1e-4, atol=2e-5)
    assert all(g.abs().sum() > 0 for g in grads.values()), "every parameter must get a gradient"


def test_frames_of_one_video_split_across_ranks_change_nothing():
    """A video cut mid-way (frames on different ranks) still maps frame by frame."""
    tower = make_tower(depth=1)
    pixels, grid = make_batch([(6, 2, 4)])
    plan = plan_frames(grid, 3, spatial_merge_size=MERGE)
    assert plan.local_grids == (((2, 2, 4),), ((2, 2, 4),), ((2, 2, 4),))
    with torch.no_grad():
        full = vision_fn(tower)(pixels, grid)
        parts = [
            vision_fn(tower)(pixels[s:e], torch.tensor(g))
            for (s, e), g in zip(plan.pixel_ranges, plan.local_grids, strict=True)
        ]
    assert_close(torch.cat(parts), full, name="video split by frames")


def test_dummy_frame_gives_zero_gradient_when_dropped():
    tower = make_tower(depth=1)
    out = vision_fn(tower)(
        torch.randn(MERGE * MERGE, PIXEL_WIDTH), torch.tensor([[1, MERGE, MERGE]])
    )
    assert out.shape == (1, 32)
    kept = torch.cat([out[:0], torch.ones(2, 32, requires_grad=True)])
    kept.sum().backward()
    grads = param_grads(tower)
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())
