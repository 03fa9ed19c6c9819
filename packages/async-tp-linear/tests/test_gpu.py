"""Real async TP on NCCL: the fused symm_mem ops run, and the result equals a 1-GPU reference.

Needs two or more CUDA devices (NCCL cannot put two ranks of one group on one GPU); skipped
otherwise. The ranks start on gloo (dist-testkit) and build an NCCL group for the TP mesh.
"""

import pytest
import torch
import torch.distributed as dist
from tp_mlp import MLP, sequence_parallel_plan

from async_tp_linear import enable_async_tp, find_fusion_patterns, swap_tp_linears
from dist_testkit import assert_close, full, run_checks

pytestmark = pytest.mark.gpu

B, H, F = 2, 256, 512


def check_real_async_tp_fuses_and_matches_reference():
    import torch._inductor.config as inductor_config
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    mesh = DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda", mesh_dim_names=("tp",))
    enable_async_tp(mesh, sequence_parallel=True)

    plan = sequence_parallel_plan()
    torch.manual_seed(0)
    ref = MLP(H, F).cuda()
    model = MLP(H, F).cuda()
    model.load_state_dict(ref.state_dict())
    swap_tp_linears(model, plan)
    parallelize_module(model, mesh, plan)

    S = 16 * world
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(B, S, H, device="cuda", generator=g)
    grad_out = torch.randn(B, S, H, device="cuda", generator=g)
    x_local = x.chunk(world, dim=1)[rank].clone().requires_grad_()

    sites = []
    with inductor_config.patch(
        force_disable_caches=True,
        post_grad_custom_post_pass=lambda graph: sites.append(find_fusion_patterns(graph)),
    ):
        out = torch.compile(model)(x_local)
        (out * grad_out.chunk(world, dim=1)[rank]).sum().backward()

    assert len(sites) == 2, sites
    for graph_sites in sites:
        kinds = sorted(s.kind for s in graph_sites if s.status == "fused")
        assert kinds == ["all_gather_matmul", "matmul_reduce_scatter"], graph_sites

    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * grad_out).sum().backward()
    tol = {"rtol": 1e-4, "atol": 1e-4}
    assert_close(out, out_ref.chunk(world, dim=1)[rank], name="out", **tol)
    assert_close(x_local.grad, x_ref.grad.chunk(world, dim=1)[rank], name="x.grad", **tol)
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert_close(full(p.grad), p_ref.grad, name=f"{name}.grad", **tol)


def check_enable_async_tp_accepts_an_nccl_mesh():
    import torch._inductor.config as inductor_config
    from torch.distributed.device_mesh import DeviceMesh

    torch.cuda.set_device(dist.get_rank())
    mesh = DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda", mesh_dim_names=("tp",))
    name = enable_async_tp(mesh, sequence_parallel=True)
    assert name == mesh.get_group().group_name
    assert inductor_config._micro_pipeline_tp is True


CHECKS = [
    check_enable_async_tp_accepts_an_nccl_mesh,
    check_real_async_tp_fuses_and_matches_reference,
]


def _world() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def report():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (async TP runs on NCCL + symmetric memory)")
    if _world() < 2:
        pytest.skip(f"needs >= 2 CUDA devices for a TP group, found {_world()}")
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    return run_checks(CHECKS, world_size=_world(), timeout=600)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_rank_check(report, check):
    report.assert_passed(check)
