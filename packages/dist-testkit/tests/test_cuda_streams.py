"""cpu_cuda_streams: stream-ordered code computes what the plain code computes, and the real
``torch.cuda`` comes back on exit."""

from __future__ import annotations

import pytest
import torch

from dist_testkit import cpu_cuda_streams, run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="stands in for a missing GPU")


def _stream_ordered(x: torch.Tensor) -> torch.Tensor:
    """What megatron-fsdp does around its copies: a side stream that waits on the current one,
    work queued on it, an event recorded and waited on, the tensor kept alive on the stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x.cuda() * 2 + 1
        y.record_stream(side)
        done = torch.cuda.Event()
        done.record()
    torch.cuda.current_stream().wait_event(done)
    done.synchronize()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return y.sum() + torch.cuda.current_device()


def test_stream_code_runs_and_equals_plain_math():
    x = torch.randn(5, 3)
    with cpu_cuda_streams():
        got = _stream_ordered(x)
        assert torch.cuda.current_stream().runs_on_cpu
    assert torch.equal(got, (x * 2 + 1).sum())


def test_real_cuda_api_restored_on_exit():
    originals = (torch.cuda.Stream, torch.cuda.stream, torch.cuda.current_device)
    with cpu_cuda_streams():
        assert torch.cuda.Stream is not originals[0]
    assert (torch.cuda.Stream, torch.cuda.stream, torch.cuda.current_device) == originals
    assert not {"cuda", "record_stream"} & set(vars(torch.Tensor))  # inherited again
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1).cuda()  # the real call again: no GPU here


def _asynchronous_collectives_complete() -> list[bool]:
    """An asynchronous all-reduce and a coalesced asynchronous all-gather (megatron-fsdp's
    parameter gathers) under the stand-ins: complete, and their results written, when the
    calls return (without the stand-ins gloo ran 62 of 63 such gathers on after the return)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    rank, world = dist.get_rank(), dist.get_world_size()
    n = 1 << 20  # big enough that gloo takes far longer than the call's return
    with cpu_cuda_streams():
        summed = torch.full((n,), float(rank + 1))
        reduced = dist.all_reduce(summed, async_op=True)
        done = [reduced.is_completed(), bool((summed == world * (world + 1) / 2).all())]
        gathered = torch.empty(world * n)
        with c10d._coalescing_manager(async_ops=True) as batch:
            dist.all_gather_into_tensor(gathered, torch.full((n,), float(rank)), async_op=True)
        done += [all(w.is_completed() for w in batch.works)]
        done += [bool((gathered == torch.arange(world).repeat_interleave(n)).all())]
    assert dist.all_reduce is c10d.all_reduce  # the real one back
    return done


def test_asynchronous_collectives_complete_before_they_return():
    for done in run_ranks(_asynchronous_collectives_complete, 2, timeout=60):
        assert done == [True] * 4, done
