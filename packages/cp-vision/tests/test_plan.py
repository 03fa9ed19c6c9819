"""plan_frames: contiguous, complete, every rank busy when it can be, optimal max cost.

References are independent: brute force over every contiguous cut (small cases) and the
textbook O(ranks · units²) dynamic program (larger cases).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_vision import DEFAULT_COST_ALPHA, plan_frames

side = st.integers(1, 6).map(lambda k: 2 * k)
grid_row = st.tuples(st.integers(1, 4), side, side)
grids = st.lists(grid_row, min_size=1, max_size=6)
alphas = st.integers(0, 300)


def frames_of(grid):
    return [(h, w) for t, h, w in grid for _ in range(t)]


def brute_force_best(costs, parts):
    """Smallest max range cost over all cuts into ``parts`` non-empty contiguous ranges."""
    n = len(costs)
    best = math.inf
    for inner in itertools.combinations(range(1, n), parts - 1):
        cuts = (0, *inner, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(cuts)))
    return best


def quadratic_dp_best(costs, parts):
    n = len(costs)
    prefix = [0, *itertools.accumulate(costs)]
    f = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    f[0][0] = 0
    for k in range(1, parts + 1):
        for j in range(1, n + 1):
            f[k][j] = min(max(f[k - 1][i], prefix[j] - prefix[i]) for i in range(j))
    return f[parts][n]


def check_structure(plan, grid, world):
    n = len(frames_of(grid))
    m2 = plan.spatial_merge_size**2
    assert len(plan.unit_ranges) == world
    # contiguous and complete, in rank order
    position = 0
    for start, end in plan.unit_ranges:
        assert start == position and end >= start
        position = end
    assert position == n
    # pixel and token ranges follow the units
    px = tok = 0
    frames = frames_of(grid)
    for rank, (start, end) in enumerate(plan.unit_ranges):
        rows = sum(h * w for h, w in frames[start:end])
        assert plan.pixel_ranges[rank] == (px, px + rows)
        assert plan.token_ranges[rank] == (tok, tok + rows // m2)
        px, tok = px + rows, tok + rows // m2
        # the local grids list exactly these frames, in order, same-video frames merged
        if plan.is_dummy(rank):
            assert plan.local_grids[rank] == (plan.dummy_grid,)
            assert plan.local_token_count(rank) == 1
        else:
            listed = [(h, w) for t, h, w in plan.local_grids[rank] for _ in range(t)]
            assert listed == frames[start:end]
            assert plan.local_token_count(rank) == rows // m2
    assert px == plan.num_pixel_rows == sum(t * h * w for t, h, w in grid)
    assert tok == plan.num_tokens


@settings(max_examples=100, deadline=None)
@given(grids, st.integers(1, 5), alphas)
def test_contiguous_complete_and_busy(grid, world, alpha):
    plan = plan_frames(torch.tensor(grid), world, cost_alpha=alpha)
    check_structure(plan, grid, world)
    n = plan.num_units
    if n >= world:
        assert not any(plan.is_dummy(r) for r in range(world)), "every rank must get a frame"
    else:
        assert [plan.is_dummy(r) for r in range(world)] == [False] * n + [True] * (world - n)
        assert all(e - s == 1 for s, e in plan.unit_ranges[:n])


@settings(max_examples=100, deadline=None)
@given(grids, st.integers(1, 4), alphas)
def test_max_cost_is_optimal_against_brute_force(grid, world, alpha):
    plan = plan_frames(grid, world, cost_alpha=alpha)
    costs = [h * w * (h * w + alpha) for h, w in frames_of(grid)]
    assert list(plan.unit_costs) == costs
    if len(costs) < world:
        return
    assert max(plan.rank_costs) == brute_force_best(costs, world)


@settings(max_examples=30, deadline=None)
@given(st.lists(grid_row, min_size=8, max_size=14), st.integers(2, 8), alphas)
def test_max_cost_is_optimal_on_larger_batches(grid, world, alpha):
    plan = plan_frames(grid, world, cost_alpha=alpha)
    costs = list(plan.unit_costs)
    if len(costs) >= world:
        assert max(plan.rank_costs) == quadratic_dp_best(costs, world)


def test_boundary_cases():
    # world 1: everything on rank 0, grid rows unchanged
    plan = plan_frames([(3, 2, 2), (1, 4, 4)], 1)
    assert plan.unit_ranges == ((0, 4),)
    assert plan.local_grids == (((3, 2, 2), (1, 4, 4)),)
    # as many units as ranks: one each
    plan = plan_frames([(2, 2, 2), (1, 4, 4)], 3)
    assert plan.unit_ranges == ((0, 1), (1, 2), (2, 3))
    assert plan.local_grids == (((1, 2, 2),), ((1, 2, 2),), ((1, 4, 4),))
    # one huge frame among small ones gets a rank to itself
    plan = plan_frames([(1, 2, 2), (1, 2, 2), (1, 16, 16), (1, 2, 2)], 2, cost_alpha=0)
    assert plan.unit_ranges == ((0, 2), (2, 4))
    assert max(plan.rank_costs) == 256 * 256 + 16
    # a single image over 4 ranks: three dummies of the smallest grid, merge size 3
    plan = plan_frames(torch.tensor([[1, 6, 3]]), 4, spatial_merge_size=3)
    assert plan.unit_ranges == ((0, 1), (1, 1), (1, 1), (1, 1))
    assert plan.local_grids[1:] == (((1, 3, 3),),) * 3
    assert plan.token_ranges[0] == (0, 2)
    # equal frames split evenly, imbalance exactly 1
    plan = plan_frames([(8, 4, 4)], 4)
    assert plan.unit_ranges == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert plan.imbalance == 1.0
    assert plan.replicated_cost == 8 * 16 * (16 + DEFAULT_COST_ALPHA)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (([(1, 2, 2)], 0), {}, ValueError, "world_size must be an int >= 1, got 0"),
        (([], 2), {}, ValueError, "grid_thw is empty"),
        (
            (torch.ones(2, 2, dtype=torch.long), 2),
            {},
            ValueError,
            r"\[n_images_or_videos, 3\], got \(2, 2\)",
        ),
        ((torch.ones(2, 3), 2), {}, TypeError, "must hold integers"),
        (([(1, 2)], 2), {}, TypeError, "rows of three ints"),
        (
            ([(1, 3, 2)], 2),
            {},
            ValueError,
            r"row 0 is \(1, 3, 2\).*multiples of spatial_merge_size=2",
        ),
        (([(0, 2, 2)], 2), {}, ValueError, "t >= 1"),
        (
            ([(1, 2, 2)], 2),
            {"cost_alpha": -1},
            ValueError,
            "cost_alpha must be a finite number >= 0",
        ),
        (
            ([(1, 2, 2)], 2),
            {"spatial_merge_size": 0},
            ValueError,
            "spatial_merge_size must be >= 1",
        ),
    ],
)
def test_bad_input_says_what_was_expected(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        plan_frames(*args, **kwargs)
