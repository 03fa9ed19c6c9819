"""run_checks: many checks in one launch, each reported on its own."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from dist_testkit import assert_close, make_mesh, named_check, run_checks


def check_mesh_named_dims() -> tuple[int, ...]:
    mesh = make_mesh((2, dist.get_world_size() // 2), ("dp", "tp"))
    assert mesh.mesh_dim_names == ("dp", "tp")
    return (mesh["dp"].size(), mesh["tp"].size())


def check_reduce() -> float:
    t = torch.ones(3)
    dist.all_reduce(t)
    assert_close(t, torch.full((3,), float(dist.get_world_size())))
    return float(t[0])


def check_agreed_failure() -> None:
    flag = torch.tensor([1.0])
    dist.all_reduce(flag)  # every rank agrees, then every rank raises: nobody hangs
    raise ValueError("agreed failure")


def check_after_failure() -> None:
    dist.barrier()


def check_hangs_on_rank_one() -> None:
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()


@pytest.mark.parametrize("world", [2, 4])
def test_checks_report_each(world):
    report = run_checks(
        [check_mesh_named_dims, check_reduce, check_agreed_failure, check_after_failure],
        world,
        timeout=60,
    )
    assert report.assert_passed(check_mesh_named_dims) == [(2, world // 2)] * world
    assert report.assert_passed("check_reduce") == [float(world)] * world
    with pytest.raises(AssertionError, match="agreed failure"):
        report.assert_passed(check_agreed_failure)
    with pytest.raises(AssertionError, match=r"not run \(check check_agreed_failure failed first"):
        report.assert_passed(check_after_failure)
    with pytest.raises(AssertionError, match="2 of 4 checks failed"):
        report.assert_all_passed()


def test_hung_check_is_attributed():
    report = run_checks([check_reduce, check_hangs_on_rank_one], 2, timeout=10)
    report.assert_passed(check_reduce)
    with pytest.raises(AssertionError, match="rank 1 hung"):
        report.assert_passed(check_hangs_on_rank_one)


def test_duplicate_names_rejected():
    with pytest.raises(ValueError, match="unique"):
        run_checks([check_reduce, check_reduce], 2)


def scaled_reduce(scale: float) -> float:
    t = torch.full((1,), scale)
    dist.all_reduce(t)
    return float(t[0])


def test_named_checks_carry_arguments():
    checks = [named_check(f"reduce_x{s}", scaled_reduce, float(s)) for s in (1, 3)]
    report = run_checks(checks, 2, timeout=60)
    assert report.assert_passed("reduce_x1") == [2.0, 2.0]
    assert report.assert_passed("reduce_x3") == [6.0, 6.0]


def check_slow_on_rank_one() -> None:
    if dist.get_rank() == 1:
        time.sleep(0.5)  # the time being measured
    dist.barrier()


def test_each_check_is_timed_by_its_slowest_rank(tmp_path, monkeypatch):
    """``CheckReport.seconds``: per passed check, the slowest rank's time from the end of the
    check before; ``DIST_TESTKIT_TIMINGS`` gets one JSON line per check."""
    timings = tmp_path / "timings.jsonl"
    monkeypatch.setenv("DIST_TESTKIT_TIMINGS", str(timings))
    report = run_checks([check_reduce, check_slow_on_rank_one, check_agreed_failure], 2, timeout=60)
    assert report.seconds["check_slow_on_rank_one"] >= 0.5
    assert report.seconds["check_reduce"] < 0.5
    assert "check_agreed_failure" not in report.seconds
    lines = [json.loads(line) for line in timings.read_text().splitlines()]
    assert lines == [{"world": 2, "check": k, "seconds": v} for k, v in report.seconds.items()]
