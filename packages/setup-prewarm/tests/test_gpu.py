"""GPU paths: cuBLAS, fla kernels, CUDA RNG and the outside-allocator memory columns.

Skipped with a reason without CUDA (and, for the fla test, without flash-linear-attention).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gdn_models import Block, TinyGDN, naive_gated_delta_rule

import setup_prewarm.runner as runner
from setup_prewarm import GDNShape, prewarm
from setup_prewarm.fla_warm import run_gdn_kernel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_fla = pytest.mark.skipif(
    importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention (fla)"
)
pytestmark = [pytest.mark.gpu, needs_cuda]


def test_cublas_step_runs_and_reports_memory():
    report = prewarm(None, comm_groups=False, fla=False)
    step = report["cublas"]
    assert step.status == "ran", report
    assert step.detail == "matmul fwd+bwd in float32, bfloat16"
    assert step.outside_before is not None and step.outside_after is not None
    assert step.outside_after >= step.outside_before - (64 << 20)  # tolerance: other processes
    assert report.device == f"cuda:{torch.cuda.current_device()}"


def test_cuda_and_cpu_rng_unchanged(monkeypatch):
    def drawing_fla(model, device):
        torch.randn(1000, device=device)
        raise RuntimeError("fails after drawing")

    monkeypatch.setattr(runner, "warm_fla", drawing_fla)
    torch.manual_seed(7)
    cpu_before, cuda_before = torch.get_rng_state(), torch.cuda.get_rng_state()
    report = prewarm(None, comm_groups=False)  # the real cuBLAS step draws on the GPU
    assert report["cublas"].status == "ran" and report["fla"].status == "failed"
    assert torch.equal(torch.get_rng_state(), cpu_before)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_before)


@needs_fla
def test_fla_step_runs_every_shape_dense_and_packed():
    model = torch.nn.Sequential(
        Block(TinyGDN(32, 2, 4, 64, 64)),
        Block(TinyGDN(32, 2, 4, 64, 64).to(torch.bfloat16)),
    ).cuda()
    report = prewarm(model, cublas=False, comm_groups=False)
    step = report["fla"]
    assert step.status == "ran", report
    assert "2 shape(s): qk 2x64 v 4x64 float32; qk 2x64 v 4x64 bfloat16" in step.detail


@needs_fla
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_fla_kernel_matches_the_naive_recurrence(packed):
    """The inputs the prewarm builds, fed to fla and to the token-by-token oracle, agree."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    outs = {}

    def capture(name, kernel):
        def run(*args, **kwargs):
            out, state = kernel(*args, **kwargs)
            outs[name] = out.detach().float().cpu()
            return out, state

        return run

    shape = GDNShape(2, 4, 32, 16, torch.float32)
    device = torch.device("cuda")
    for name, kernel in (("fla", chunk_gated_delta_rule), ("naive", naive_gated_delta_rule)):
        torch.manual_seed(3)
        run_gdn_kernel(capture(name, kernel), shape, device, packed=packed)
    torch.testing.assert_close(outs["fla"], outs["naive"], rtol=1e-2, atol=1e-2)
