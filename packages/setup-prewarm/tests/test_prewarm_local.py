"""prewarm in one process: RNG untouched, failures isolated, skips explained, bad input named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import setup_prewarm.runner as prewarm_module
from setup_prewarm import PrewarmReport, StepReport, prewarm


def draw_then_raise(*args, **kwargs):
    torch.rand(100)
    torch.randn(3, 3)
    raise RuntimeError("boom in the middle of a step")


def test_cpu_rng_state_unchanged_even_when_a_step_draws_and_fails(monkeypatch):
    drawn = []

    def drawing_step(*args, **kwargs):
        drawn.append(torch.rand(5))
        return "drew numbers"

    monkeypatch.setattr(prewarm_module, "warm_cublas", drawing_step)
    monkeypatch.setattr(prewarm_module, "warm_fla", draw_then_raise)
    model = nn.Linear(2, 2)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    expected_next = torch.rand(8)
    torch.set_rng_state(before)
    report = prewarm(model, device="cpu")
    assert drawn, "the patched step must have drawn from the CPU generator"
    assert report["cublas"].status == "ran"
    assert report["fla"].status == "failed"
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(torch.rand(8), expected_next)


def test_a_failing_step_is_recorded_and_the_others_still_run(monkeypatch):
    calls = []
    monkeypatch.setattr(prewarm_module, "warm_cublas", draw_then_raise)
    monkeypatch.setattr(prewarm_module, "warm_groups", lambda targets, device: "unused")

    def fla_step(model, device):
        calls.append(device)
        return "fla ran"

    monkeypatch.setattr(prewarm_module, "warm_fla", fla_step)
    report = prewarm(None, device="cpu")
    cublas = report["cublas"]
    assert cublas.status == "failed"
    assert cublas.error == "RuntimeError: boom in the middle of a step"
    assert "draw_then_raise" in cublas.traceback
    assert cublas.seconds >= 0
    assert report["comm_groups"].status == "skipped"
    assert report["fla"].status == "ran" and report["fla"].detail == "fla ran"
    assert calls == [torch.device("cpu")]
    assert not report.ok and report.failed == (cublas,)
    assert "RuntimeError: boom" in str(report)


def test_cpu_skips_and_disabled_steps_say_why():
    report = prewarm(device="cpu", cublas=True, comm_groups=False, fla=False)
    assert [s.name for s in report.steps] == ["cublas", "comm_groups", "fla"]
    assert report["cublas"].reason == "cuBLAS needs a CUDA device, got cpu"
    assert report["comm_groups"].reason == "disabled (comm_groups=False)"
    assert report["fla"].reason == "disabled (fla=False)"
    assert report.ok
    assert all(s.outside_before is None and s.outside_after is None for s in report.steps)


def test_comm_step_without_groups_is_skipped():
    step = prewarm(nn.Linear(2, 2), device="cpu")["comm_groups"]
    assert step.status == "skipped"
    assert step.reason == "no process groups: no DTensor parameters and no groups given"


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module or None, got dict"):
        prewarm({}, device="cpu")
    with pytest.raises(TypeError, match=r"single dtype torch.float32"):
        prewarm(device="cpu", dtypes=torch.float32)
    with pytest.raises(ValueError, match=r"floating-point .* got torch.int32"):
        prewarm(device="cpu", dtypes=(torch.float32, torch.int32))
    with pytest.raises(TypeError, match=r"torch.dtype objects, got str 'bf16'"):
        prewarm(device="cpu", dtypes=("bf16",))
    with pytest.raises(TypeError, match=r"ProcessGroup or DeviceMesh objects, got int"):
        prewarm(device="cpu", groups=[3])
    with pytest.raises(
        TypeError, match=r"device must be a torch.device, str, int or None, got float"
    ):
        prewarm(device=1.5)
    with pytest.raises(ValueError, match=r"CPU or CUDA device, got meta"):
        prewarm(device="meta")


def test_report_table_lists_every_step():
    report = PrewarmReport(
        device="cuda:0",
        steps=(
            StepReport(
                "cublas", "ran", 0.25, detail="matmul", outside_before=0, outside_after=3 << 20
            ),
            StepReport("comm_groups", "skipped", 0.0, reason="no groups"),
            StepReport("fla", "failed", 1.5, error="ImportError: x"),
        ),
    )
    lines = report.table().splitlines()
    assert lines[0] == "prewarm on cuda:0"
    assert lines[1].split() == [
        "step",
        "status",
        "seconds",
        "outside",
        "MiB",
        "before",
        "after",
        "note",
    ]
    assert lines[3].split() == ["cublas", "ran", "0.250", "0.0", "3.0", "matmul"]
    assert lines[4].split() == ["comm_groups", "skipped", "0.000", "-", "-", "no", "groups"]
    assert lines[5].split() == ["fla", "failed", "1.500", "-", "-", "ImportError:", "x"]
    assert str(report) == report.table()
    assert report["cublas"].outside_delta == 3 << 20
    assert report["fla"].outside_delta is None
    with pytest.raises(KeyError, match=r"no step named 'nccl'"):
        report["nccl"]
