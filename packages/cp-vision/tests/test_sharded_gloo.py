"""run_vision_sharded on real gloo groups (world 2 and 4, one launch each) against the
replicated run: every rank encodes every frame and the parameter gradients of all ranks' losses
are summed (what DDP / FSDP over the CP group does)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tiny_tower import make_batch, make_tower, param_grads, vision_fn

from cp_vision import plan_frames, run_vision_sharded
from dist_testkit import assert_close, assert_grads_close, make_mesh, run_checks

GRIDS = {
    "images": [(1, 4, 4), (1, 2, 2), (1, 2, 6), (1, 4, 2), (1, 6, 6), (1, 2, 4)],
    "video": [(7, 4, 2)],
    "mixed": [(1, 4, 4), (3, 2, 4), (1, 2, 2), (2, 6, 2)],
    "fewer_frames_than_ranks": [(1, 4, 2)],
}


def _rank_weight(n_tokens: int, rank: int) -> torch.Tensor:
    """Each rank's loss reads the output differently (as CP ranks do with their own tokens)."""
    return torch.randn(n_tokens, 32, generator=torch.Generator().manual_seed(100 + rank))


def _replicated(grid, world):
    """Single-process reference: full tower, loss = sum over ranks of each rank's loss."""
    tower = make_tower()
    pixels, grid_thw = make_batch(grid)
    out = vision_fn(tower)(pixels, grid_thw)
    loss = sum((out * _rank_weight(out.shape[0], r)).sum() for r in range(world))
    loss.backward()
    return out.detach(), param_grads(tower)


def check_trainable_matches_replicated() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, grid in GRIDS.items():
        ref_out, ref_grads = _replicated(grid, world)
        tower = make_tower()
        pixels, grid_thw = make_batch(grid)
        out = run_vision_sharded(vision_fn(tower), pixels, grid_thw, None, trainable=True)
        assert_close(out, ref_out, name=f"{name} output")
        (out * _rank_weight(out.shape[0], rank)).sum().backward()
        grads = param_grads(tower)  # a dummy rank still has (zero) gradients, never None
        for g in grads.values():
            dist.all_reduce(g)
        assert_grads_close(grads, ref_grads, rtol=1e-4, atol=2e-5)


def check_explicit_plan_and_cp_submesh() -> None:
    """A caller-made plan (other cost model) over a 1-D CP DeviceMesh gives the same result."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = GRIDS["mixed"]
    ref_out, ref_grads = _replicated(grid, world)
    tower = make_tower()
    pixels, grid_thw = make_batch(grid)
    plan = plan_frames(grid_thw, world, cost_alpha=0)
    cp_mesh = make_mesh((world,), ("cp",))
    out = run_vision_sharded(vision_fn(tower), pixels, grid_thw, cp_mesh, trainable=True, plan=plan)
    assert_close(out, ref_out, name="output")
    (out * _rank_weight(out.shape[0], rank)).sum().backward()
    grads = param_grads(tower)
    for g in grads.values():
        dist.all_reduce(g)
    assert_grads_close(grads, ref_grads, rtol=1e-4, atol=2e-5)


def check_group_of_one_runs_plain_path() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    solo = make_mesh((world, 1), ("cp", "solo"))["solo"]
    tower, ref = make_tower(), make_tower()
    pixels, grid_thw = make_batch(GRIDS["mixed"])
    out = run_vision_sharded(vision_fn(tower), pixels, grid_thw, solo, trainable=True)
    ref_out = vision_fn(ref)(pixels, grid_thw)
    assert_close(out, ref_out, name="output")
    weight = _rank_weight(out.shape[0], rank)
    (out * weight).sum().backward()
    (ref_out * weight).sum().backward()
    assert_grads_close(tower, ref)


def check_frozen_tower_has_no_graph() -> None:
    tower = make_tower()
    pixels, grid_thw = make_batch(GRIDS["images"])
    out = run_vision_sharded(vision_fn(tower), pixels, grid_thw, None, trainable=False)
    with torch.no_grad():
        assert_close(out, vision_fn(make_tower())(pixels, grid_thw), name="frozen output")
    assert not out.requires_grad


def check_frozen_over_cp_tp_mesh() -> None:
    mesh = make_mesh((2, 2), ("cp", "tp"))
    cp_tp = mesh._flatten("cp_tp")
    for name, grid in GRIDS.items():
        tower = make_tower()
        pixels, grid_thw = make_batch(grid)
        out = run_vision_sharded(
            vision_fn(tower), pixels, grid_thw, cp_tp, trainable=False, tp_replicated=True
        )
        with torch.no_grad():
            assert_close(out, vision_fn(tower)(pixels, grid_thw), name=f"{name} frozen output")
        assert not out.requires_grad
        assert all(p.grad is None for p in tower.parameters())


def check_trainable_over_tp_replicas_raises() -> None:
    tower = make_tower()
    pixels, grid_thw = make_batch(GRIDS["images"])
    with pytest.raises(ValueError, match="counted tp times"):
        run_vision_sharded(
            vision_fn(tower), pixels, grid_thw, None, trainable=True, tp_replicated=True
        )


def check_trainable_over_2d_mesh_raises() -> None:
    mesh = make_mesh((2, 2), ("cp", "tp"))
    pixels, grid_thw = make_batch(GRIDS["images"])
    with pytest.raises(ValueError, match=r"must be 1-D, got dims \('cp', 'tp'\)"):
        run_vision_sharded(vision_fn(make_tower()), pixels, grid_thw, mesh, trainable=True)
    with pytest.raises(ValueError, match="counted tp times"):
        run_vision_sharded(
            vision_fn(make_tower()),
            pixels,
            grid_thw,
            mesh._flatten("cp_tp"),
            trainable=True,
            tp_replicated=True,
        )


def check_bad_arguments_raise() -> None:
    pixels, grid_thw = make_batch(GRIDS["images"])
    fn, world = vision_fn(make_tower()), dist.get_world_size()
    cases = [
        ((fn, pixels, grid_thw.tolist(), None), {}, TypeError, "grid_thw must be a tensor"),
        ((fn, pixels.numpy(), grid_thw, None), {}, TypeError, "pixel_values must be a tensor"),
        ((fn, pixels[None], grid_thw, None), {}, ValueError, "pixel_values must be 2-D"),
        ((fn, pixels, grid_thw, "world"), {}, TypeError, "ProcessGroup or a 1-D DeviceMesh"),
        (
            (fn, pixels, grid_thw, None),
            {"plan": plan_frames(grid_thw, world + 1)},
            ValueError,
            rf"plan was made for world {world + 1} .* group size {world}",
        ),
        ((fn, pixels, grid_thw, None), {"plan": "plan"}, TypeError, "plan must be a FramePlan"),
    ]
    for args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            run_vision_sharded(*args, trainable=True, **kwargs)


def check_plans_that_differ_between_ranks_raise() -> None:
    # Cost models that cut this batch differently at world 2 and at world 4.
    grid = [(1, 4, 6), (1, 4, 6), (1, 8, 2), (1, 2, 4), (1, 4, 2), (1, 2, 2), (1, 2, 4)]
    pixels, grid_thw = make_batch(grid)
    plan = plan_frames(grid_thw, dist.get_world_size(), cost_alpha=0 if dist.get_rank() else 10**6)
    with pytest.raises(ValueError, match="the ranks of the group disagree"):
        run_vision_sharded(
            vision_fn(make_tower()), pixels, grid_thw, None, trainable=True, plan=plan
        )


def check_divergent_grid_raises_everywhere() -> None:
    grid = GRIDS["images"] if dist.get_rank() != 1 else GRIDS["mixed"]
    pixels, grid_thw = make_batch(grid)
    with pytest.raises(ValueError, match="the ranks of the group disagree"):
        run_vision_sharded(vision_fn(make_tower()), pixels, grid_thw, None, trainable=True)


def check_bad_pixel_rows_on_one_rank_raises_everywhere() -> None:
    pixels, grid_thw = make_batch(GRIDS["video"])
    expected = r"pixel_values has 55 rows, grid_thw .* needs sum\(t·h·w\) = 56"
    if dist.get_rank() == 0:
        pixels = pixels[:-1]
    else:
        expected = r"rank\(s\) \[0\] of the group failed"
    with pytest.raises(ValueError, match=expected):
        run_vision_sharded(vision_fn(make_tower()), pixels, grid_thw, None, trainable=True)


def check_wrong_token_count_raises_everywhere() -> None:
    tower = make_tower()
    pixels, grid_thw = make_batch(GRIDS["mixed"])

    def short_on_last_rank(pv, g):
        out = vision_fn(tower)(pv, g)
        return out[:-1] if dist.get_rank() == dist.get_world_size() - 1 else out

    last = dist.get_world_size() - 1
    expected = (
        r"vision_fn returned shape \(\d+, 32\) .* expected \[\d+, D\]"
        if dist.get_rank() == last
        else rf"rank\(s\) \[{last}\] of the group failed"
    )
    with pytest.raises(ValueError, match=expected):
        run_vision_sharded(short_on_last_rank, pixels, grid_thw, None, trainable=True)


def check_tower_exception_reraised_and_peers_raise() -> None:
    def broken_on_rank_one(pv, g):
        if dist.get_rank() == 1:
            raise RuntimeError("tower blew up")
        return vision_fn(make_tower())(pv, g)

    pixels, grid_thw = make_batch(GRIDS["images"])
    error, match = (
        (RuntimeError, "tower blew up") if dist.get_rank() == 1 else (ValueError, "failed")
    )
    with pytest.raises(error, match=match):
        run_vision_sharded(broken_on_rank_one, pixels, grid_thw, None, trainable=True)


def check_group_still_usable_after_errors() -> None:
    """Nobody was left inside a collective: a normal call after the failures pairs up."""
    tower = make_tower()
    pixels, grid_thw = make_batch(GRIDS["video"])
    out = run_vision_sharded(vision_fn(tower), pixels, grid_thw, None, trainable=False)
    with torch.no_grad():
        assert_close(out, vision_fn(tower)(pixels, grid_thw), name="output after errors")


COMMON = [
    check_trainable_matches_replicated,
    check_explicit_plan_and_cp_submesh,
    check_group_of_one_runs_plain_path,
    check_frozen_tower_has_no_graph,
    check_trainable_over_tp_replicas_raises,
    check_bad_arguments_raise,
    check_plans_that_differ_between_ranks_raise,
    check_divergent_grid_raises_everywhere,
    check_bad_pixel_rows_on_one_rank_raises_everywhere,
    check_wrong_token_count_raises_everywhere,
    check_tower_exception_reraised_and_peers_raise,
]
WORLD4_ONLY = [check_frozen_over_cp_tp_mesh, check_trainable_over_2d_mesh_raises]
CHECKS = {
    2: [*COMMON, check_group_still_usable_after_errors],
    4: [*COMMON, *WORLD4_ONLY, check_group_still_usable_after_errors],
}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def report(request):
    return run_checks(CHECKS[request.param], request.param, timeout=150)


@pytest.mark.parametrize(
    "check",
    [*COMMON, *WORLD4_ONLY, check_group_still_usable_after_errors],
    ids=lambda c: c.__name__,
)
def test_rank_check(report, check):
    if check not in CHECKS[report.world_size]:
        pytest.skip(f"{check.__name__} needs a 2×2 CP×TP mesh (world 4)")
    report.assert_passed(check)
