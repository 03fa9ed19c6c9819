"""Communicator step and CLI on gloo world 4 with a 2×2 (dp, tp) mesh plus a flattened dp_tp.

Each rank counts its ``torch.distributed.all_reduce`` calls per process group (by wrapping the
function) and compares them with the groups it belongs to, derived independently from the mesh
layout ``[[0, 1], [2, 3]]``: every group must be all-reduced exactly once.
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dist_testkit import make_mesh, run_checks
from setup_prewarm import collect_groups, prewarm
from setup_prewarm.cli import main


@contextlib.contextmanager
def counting_all_reduce(fail_on: str | None = None):
    """Count all-reduces per group as (sorted member ranks); optionally fail one group."""
    calls: Counter[tuple[int, ...]] = Counter()
    original = dist.all_reduce

    def wrapped(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        ranks = tuple(sorted(dist.get_process_group_ranks(group or dist.group.WORLD)))
        calls[ranks, getattr(group, "group_name", "world")] += 1
        if fail_on is not None and group is not None and group.group_name == fail_on:
            raise RuntimeError("injected failure")
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = wrapped
    try:
        yield calls
    finally:
        dist.all_reduce = original


def my_groups() -> dict[str, tuple[int, ...]]:
    """This rank's groups in the 2×2 mesh [[0, 1], [2, 3]], from the layout alone."""
    r = dist.get_rank()
    return {"dp": (r % 2, r % 2 + 2), "tp": (r - r % 2, r - r % 2 + 1), "dp_tp": (0, 1, 2, 3)}


class MeshModel(nn.Module):
    """DTensor parameters on both dims, on each 1-D submesh, on the flattened dim; one plain."""

    def __init__(self, mesh, flat):
        super().__init__()
        torch.manual_seed(0)
        self.both = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0), Shard(1)]))
        self.tp_only = nn.Parameter(distribute_tensor(torch.randn(4), mesh["tp"], [Shard(0)]))
        self.dp_only = nn.Parameter(distribute_tensor(torch.randn(4), mesh["dp"], [Replicate()]))
        self.flat = nn.Parameter(distribute_tensor(torch.randn(8), flat, [Shard(0)]))
        self.plain = nn.Parameter(torch.randn(3))


@functools.cache
def _mesh_and_model():
    """One mesh per rank process, shared by the checks (creating gloo groups costs seconds)."""
    mesh = make_mesh((2, 2), ("dp", "tp"))
    flat = mesh["dp", "tp"]._flatten()
    return mesh, flat, MeshModel(mesh, flat)


def check_every_group_exactly_once():
    mesh, flat, model = _mesh_and_model()
    with counting_all_reduce() as calls:
        report = prewarm(model, device="cpu", groups=[mesh["tp"].get_group(), mesh])
    assert report["comm_groups"].status == "ran", report
    assert report["comm_groups"].detail == "all-reduced 3 group(s): dp(2), tp(2), dp_tp(4)"
    by_ranks = Counter({ranks: n for (ranks, _), n in calls.items()})
    assert by_ranks == Counter({ranks: 1 for ranks in my_groups().values()}), calls
    expected_names = {g.group_name for g in [*mesh.get_all_groups(), flat.get_group()]}
    assert {name for _, name in calls} == expected_names
    return report["comm_groups"].detail


def check_explicit_new_group_is_touched_once():
    _mesh, flat, model = _mesh_and_model()
    extra = dist.new_group([0, 1, 2, 3])  # same ranks as dp_tp, but its own communicator
    with counting_all_reduce() as calls:
        report = prewarm(model, device="cpu", groups=[extra, extra, flat])
    assert report["comm_groups"].status == "ran", report
    assert sorted(calls.values()) == [1, 1, 1, 1]
    assert (tuple(range(4)), extra.group_name) in calls
    assert len(collect_groups(model, [extra])) == 4


def check_failed_group_is_reported_and_later_groups_still_run():
    mesh, _flat, model = _mesh_and_model()
    with counting_all_reduce(fail_on=mesh.get_group("tp").group_name) as calls:
        report = prewarm(model, device="cpu")
    step = report["comm_groups"]
    assert step.status == "failed", report
    assert (
        step.error
        == "RuntimeError: 1 of 3 group all-reduces failed: tp: RuntimeError: injected failure"
    )
    assert sorted(ranks for ranks, _ in calls) == sorted(my_groups().values())
    assert report["fla"].status == "skipped"


def check_cli_main_prewarms_mesh_and_flattened_dims():
    out = io.StringIO()
    with counting_all_reduce() as calls, contextlib.redirect_stdout(out):
        code = main(["--mesh", "2x2", "--names", "dp,tp", "--flatten", "dp,tp", "--device", "cpu"])
    assert code == 0, out.getvalue()
    by_ranks = Counter({ranks: n for (ranks, _), n in calls.items()})
    assert by_ranks == Counter({ranks: 1 for ranks in my_groups().values()}), calls
    text = out.getvalue()
    assert f"[rank {dist.get_rank()}/4] prewarm on cpu" in text
    assert "all-reduced 3 group(s): dp(2), tp(2), dp_tp(4)" in text
    return text


def check_cli_bad_mesh_returns_2_without_collectives():
    err = io.StringIO()
    with counting_all_reduce() as calls, contextlib.redirect_stderr(err):
        code = main(["--mesh", "3x1", "--names", "dp,tp"])
    assert code == 2 and not calls
    assert "--mesh 3x1 holds 3 ranks, world is 4" in err.getvalue()


CHECKS = [
    check_every_group_exactly_once,
    check_explicit_new_group_is_touched_once,
    check_failed_group_is_reported_and_later_groups_still_run,
    check_cli_main_prewarms_mesh_and_flattened_dims,
    check_cli_bad_mesh_returns_2_without_collectives,
]


@pytest.fixture(scope="module")
def report():
    return run_checks(CHECKS, 4, timeout=180)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_world4(report, check):
    report.assert_passed(check)
