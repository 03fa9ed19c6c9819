"""dist-testkit proves its own promises: results come back; a rank's exception surfaces with
its traceback; a hanging rank is killed within the timeout and named; a crashing rank is
reported with its exit code — at world 2 and 4."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_testkit import RankError, run_ranks


def rank_sum(scale: float) -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t.item()) * scale


def uneven_all_to_all() -> list[int]:
    # Rank r sends r+1 rows to each peer except the next one, which gets none (zero splits).
    rank, world = dist.get_rank(), dist.get_world_size()
    send = [0 if (r == (rank + 1) % world and world > 1) else rank + 1 for r in range(world)]
    recv = [0 if (rank == (r + 1) % world and world > 1) else r + 1 for r in range(world)]
    out = torch.empty(sum(recv))
    dist.all_to_all_single(out, torch.full((sum(send),), float(rank)), recv, send)
    return out.tolist()


def raise_on_last_rank() -> None:
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError("deliberate failure from the last rank")
    dist.barrier()  # the healthy ranks wait for the failed one: must not hang the launch


def hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        time.sleep(3600)


def crash_on_rank_one() -> None:
    # every rank first finishes joining the group: a peer that returns (and exits) while rank 1
    # is still connecting would otherwise fail rank 1's start-up instead (seen under load)
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(17)


@pytest.mark.parametrize("world", [2, 4])
def test_results_come_back(world):
    results = run_ranks(rank_sum, world, 2.0, timeout=60)
    total = world * (world + 1) / 2
    assert results == [(r, world, total * 2.0) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_all_to_all_with_zero_splits(world):
    results = run_ranks(uneven_all_to_all, world, timeout=60)
    for rank, got in enumerate(results):
        expected = [
            float(r) for r in range(world) for _ in range(0 if rank == (r + 1) % world else r + 1)
        ]
        assert got == expected


@pytest.mark.parametrize("world", [2, 4])
def test_exception_surfaces_with_traceback(world):
    with pytest.raises(RankError) as info:
        run_ranks(raise_on_last_rank, world, timeout=60)
    msg = str(info.value)
    assert f"rank {world - 1}" in msg
    assert "deliberate failure from the last rank" in msg
    assert "Traceback (most recent call last)" in msg
    assert "raise_on_last_rank" in msg  # the failing frame is in the traceback


@pytest.mark.parametrize("world", [2, 4])
def test_hanging_rank_is_killed_and_named(world):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(hang_on_rank_zero, world, timeout=8)
    elapsed = time.monotonic() - start
    assert elapsed < 8 + 90, f"launch took {elapsed:.1f}s with an 8s timeout (start-up included)"
    assert "after start-up" in str(info.value)
    assert "rank 0 hung" in str(info.value)


@pytest.mark.parametrize("world", [2, 4])
def test_crashing_rank_is_reported(world):
    with pytest.raises(RankError) as info:
        run_ranks(crash_on_rank_one, world, timeout=60)
    assert "rank 1 exited with code 17" in str(info.value)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_ranks(rank_sum, 0, 1.0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        run_ranks(rank_sum, 2, 1.0, timeout=0)
