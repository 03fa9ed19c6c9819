"""TP + sequence-parallel MLP on a 2-rank gloo group, compiled: graph shape and the real rewrite.

One launch runs every check. The compiled checks patch Inductor's ``micro_pipeline_tp_pass`` with
a wrapper that records ``find_fusion_patterns`` on the exact graph the pass receives (before) and
returns (after). To let the REAL pass rewrite on CPU, the compiled checks run inside
``dist_testkit.cpu_micro_pipeline_tp`` (the test ranks only): the pass's availability checks pass
(NCCL present, symmetric memory enabled for the group) and the fused ops get CPU kernels, torch's
own reference implementations of them (written with functional collectives), so the fused op's
outputs have exactly the strides Inductor planned for. The compiled outputs and gradients are
then compared with a plain single-process MLP.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from compile_helpers import no_graph_cache
from tp_mlp import MLP, sequence_parallel_plan

from async_tp_linear import enable_async_tp, find_fusion_patterns, swap_tp_linears
from dist_testkit import assert_close, cpu_micro_pipeline_tp, full, make_mesh, run_checks

B, S, H, F = 2, 8, 16, 32


def _compile_and_record(model_tp, x_local, grad_local):
    """Compile + run with the pass on (fwd+bwd, or only fwd when ``grad_local`` is None) inside
    ``cpu_micro_pipeline_tp``; per graph: sites before/after the pass, and with the pass's
    checks in their natural CPU state (failing); the fused kernels' calls."""
    import torch._inductor.config as inductor_config
    from torch._inductor.fx_passes import micro_pipeline_tp, post_grad
    from torch.distributed import _symmetric_memory as symm_mem

    records = []
    real_pass = post_grad.micro_pipeline_tp_pass
    natural_checks = (dist.is_nccl_available, symm_mem.is_symm_mem_enabled_for_group)

    def recording_pass(graph):
        with (
            mock.patch.object(dist, "is_nccl_available", natural_checks[0]),
            mock.patch.object(symm_mem, "is_symm_mem_enabled_for_group", natural_checks[1]),
        ):
            closed = find_fusion_patterns(graph)
        before = find_fusion_patterns(graph)
        real_pass(graph)
        after = find_fusion_patterns(graph)
        records.append(
            {
                "backward": micro_pipeline_tp._is_backward(graph),
                "closed": closed,
                "before": before,
                "after": after,
            }
        )

    post_grad.micro_pipeline_tp_pass = recording_pass
    try:
        with (
            no_graph_cache(),
            inductor_config.patch(_micro_pipeline_tp=True),
            cpu_micro_pipeline_tp() as calls,
        ):
            torch._dynamo.reset()
            if grad_local is None:
                with torch.no_grad():
                    out = torch.compile(model_tp)(x_local)
            else:
                out = torch.compile(model_tp)(x_local)
                (out * grad_local).sum().backward()
    finally:
        post_grad.micro_pipeline_tp_pass = real_pass
        torch._dynamo.reset()
    return out, records, calls


def _setup(use_tp_linear):
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = make_mesh((2,), ("tp",))
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = MLP(H, F)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = MLP(H, F)
    model.load_state_dict(ref.state_dict())
    if use_tp_linear:
        assert swap_tp_linears(model, sequence_parallel_plan()) == ["up", "down"]
    parallelize_module(model, mesh, sequence_parallel_plan())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, generator=g)
    grad_out = torch.randn(B, S, H, generator=g)
    x_local = x.chunk(2, dim=1)[rank].clone().requires_grad_()
    return ref, model, x, grad_out, x_local, grad_out.chunk(2, dim=1)[rank]


def _check_numerics(ref, model, x, grad_out, x_local, out_local):
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * grad_out).sum().backward()
    rank = dist.get_rank()
    assert_close(out_local, out_ref.chunk(2, dim=1)[rank], rtol=1e-5, atol=1e-5, name="out")
    assert_close(
        x_local.grad, x_ref.grad.chunk(2, dim=1)[rank], rtol=1e-5, atol=1e-5, name="x.grad"
    )
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert_close(full(p.grad), p_ref.grad, rtol=1e-5, atol=1e-5, name=f"{name}.grad")


def _by_kind(sites, kind):
    return [s for s in sites if s.kind == kind]


def check_tplinear_mlp_is_fused_and_exact():
    ref, model, x, grad_out, x_local, grad_local = _setup(use_tp_linear=True)
    out, records, calls = _compile_and_record(model, x_local, grad_local)
    assert [r["backward"] for r in records] == [False, True], records
    for r in records:
        graph = "backward" if r["backward"] else "forward"
        # One all-gather->mm and one mm->reduce-scatter per graph, both accepted by the pass.
        for kind in ("all_gather_matmul", "matmul_reduce_scatter"):
            before = _by_kind(r["before"], kind)
            assert [s.status for s in before] == ["would_fuse"], (graph, kind, before)
            assert len(before[0].matmuls) == 1, (graph, before)
            # CPU, gates closed: same structure, the reason names the missing piece.
            closed = _by_kind(r["closed"], kind)
            assert [s.status for s in closed] == ["matchable"], (graph, kind, closed)
            assert "symmetric memory" in closed[0].reason or "NCCL" in closed[0].reason
            # After the real pass: the collective is gone, the fused op is there.
            after = _by_kind(r["after"], kind)
            assert [s.status for s in after] == ["fused"], (graph, kind, after)
            assert after[0].dim == before[0].dim and after[0].group_name == before[0].group_name
    assert calls["fused_all_gather_matmul"] >= 2, calls
    assert calls["fused_matmul_reduce_scatter"] >= 2, calls
    _check_numerics(ref, model, x, grad_out, x_local, out)
    return {"records": len(records), "calls": dict(calls)}


def check_plain_linear_mlp_is_not_fusable_in_forward():
    """Negative control: nn.Linear with a bias lowers to addmm, which the pass cannot match.
    Forward only (an inference graph), to spare a second backward compile."""
    ref, model, x, _, x_local, _ = _setup(use_tp_linear=False)
    out, records, _ = _compile_and_record(model, x_local.detach(), None)
    assert len(records) == 1, records
    forward = records[0]
    assert len(forward["before"]) == 2, forward["before"]
    for site in forward["before"]:
        assert site.status == "unmatched", site
        assert "addmm" in site.reason, site
    assert [s.status for s in forward["after"]] == ["unmatched", "unmatched"], forward["after"]
    assert_close(out, ref(x).chunk(2, dim=1)[dist.get_rank()], rtol=1e-5, atol=1e-5, name="out")
    return [s.reason for s in forward["before"]]


def check_enable_async_tp_refuses_on_cpu():
    import torch._inductor.config as inductor_config

    mesh = make_mesh((2,), ("tp",))
    before = inductor_config._micro_pipeline_tp
    with pytest.raises(TypeError, match="tp_mesh must be a DeviceMesh, got ProcessGroup"):
        enable_async_tp(dist.group.WORLD, sequence_parallel=True)
    with pytest.raises(TypeError, match="sequence_parallel must be a bool, got int"):
        enable_async_tp(mesh, sequence_parallel=1)
    with pytest.raises(ValueError, match="async TP needs sequence parallel"):
        enable_async_tp(mesh, sequence_parallel=False)
    with pytest.raises(RuntimeError, match=r"needs a CUDA \(or XPU\) mesh .* on 'cpu'"):
        enable_async_tp(mesh, sequence_parallel=True)
    mesh_2d = make_mesh((1, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"must be 1-D .* got a 2-D mesh with dims \('dp', 'tp'\)"):
        enable_async_tp(mesh_2d, sequence_parallel=True)
    assert inductor_config._micro_pipeline_tp == before


def check_tplinear_mlp_eager_is_exact():
    """Eager TP+SP with TPLinear: the row-parallel bias is added after TPLinear's own
    reduce-scatter (reduce_output_to), and everything equals the plain MLP."""
    from torch.distributed.tensor import Shard

    ref, model, x, grad_out, x_local, grad_local = _setup(use_tp_linear=True)
    assert model.down.reduce_output_to == (Shard(1),) and model.up.reduce_output_to is None
    out = model(x_local)
    (out * grad_local).sum().backward()
    _check_numerics(ref, model, x, grad_out, x_local, out)


def check_flatten_rule_for_dtensor_inputs():
    """A DTensor sharded on a leading dim cannot be flattened by a view: F.linear path."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from async_tp_linear.linear import _flattenable

    mesh = make_mesh((2,), ("tp",))
    local = torch.randn(2, 4, 6)
    expect = {Replicate(): True, Partial(): True, Shard(2): True, Shard(1): False, Shard(0): False}
    for placement, flattenable in expect.items():
        dt = DTensor.from_local(local, mesh, [placement], run_check=False)
        assert _flattenable(dt) is flattenable, placement
    assert _flattenable(local)


CHECKS = [
    check_enable_async_tp_refuses_on_cpu,
    check_flatten_rule_for_dtensor_inputs,
    check_tplinear_mlp_eager_is_exact,
    check_tplinear_mlp_is_fused_and_exact,
    check_plain_linear_mlp_is_not_fusable_in_forward,
]


@pytest.fixture(scope="module")
def report():
    return run_checks(CHECKS, world_size=2, timeout=300)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_rank_check(report, check):
    report.assert_passed(check)


def test_the_refusal_is_known_before_any_group_exists():
    """A launcher asks before building meshes: the same reason ``enable_async_tp`` gives."""
    from async_tp_linear import async_tp_refusal

    assert "needs a CUDA (or XPU) mesh" in async_tp_refusal("cpu")
    assert "on 'meta'" in async_tp_refusal("meta")
