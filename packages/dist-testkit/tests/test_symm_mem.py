"""cpu_micro_pipeline_tp: the fused collective-matmul ops run on CPU ranks and equal the unfused
math, their calls are counted, and the pass's checks come back on exit."""

from __future__ import annotations

import pytest
import torch

from dist_testkit import cpu_micro_pipeline_tp, run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="stands in for a missing GPU")


def _fused_ops_equal_the_unfused_math() -> dict[str, int]:
    """Each rank's shard of A [4, 3] rows: the fused all-gather-matmul equals gathering and
    multiplying, the fused matmul-reduce-scatter equals multiplying, summing over ranks and
    keeping this rank's rows."""
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm_mem

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    g = torch.Generator().manual_seed(0)
    A = torch.randn(4 * world, 3, generator=g)  # the same on every rank
    B = torch.randn(3, 5, generator=g)
    partial = A * (rank + 1)  # what each rank holds before the reduce-scatter
    checks_before = (dist.is_nccl_available, symm_mem.is_symm_mem_enabled_for_group)
    with cpu_micro_pipeline_tp() as calls:
        assert dist.is_nccl_available() and symm_mem.is_symm_mem_enabled_for_group(group)
        A_full, (AB,) = torch.ops.symm_mem.fused_all_gather_matmul(
            A.chunk(world)[rank], [B], 0, group
        )
        scattered = torch.ops.symm_mem.fused_matmul_reduce_scatter(partial, B, "sum", 0, group)
    torch.testing.assert_close(A_full, A)
    torch.testing.assert_close(AB, A @ B)
    summed = sum((A * (r + 1)) @ B for r in range(world))
    torch.testing.assert_close(scattered, summed.chunk(world)[rank])
    assert (dist.is_nccl_available, symm_mem.is_symm_mem_enabled_for_group) == checks_before
    return dict(calls)


def test_fused_ops_run_on_cpu_ranks_counted():
    for calls in run_ranks(_fused_ops_equal_the_unfused_math, 2, timeout=60):
        assert calls == {"fused_all_gather_matmul": 1, "fused_matmul_reduce_scatter": 1}, calls
