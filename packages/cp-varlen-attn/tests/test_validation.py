"""Layout agreement once per step: after ``validate_layout`` the CP calls run no validation
collective (counted with a dispatch mode, forward and backward), the first call with a fresh
layout object agrees by itself, every refusal is raised on every rank, and agreement tensors
live on the group's device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import cu_from_lengths
from torch.utils._python_dispatch import TorchDispatchMode

from cp_varlen_attn import (
    causal_conv1d,
    gated_delta_rule,
    plan_cp_layout,
    shard_sequence,
    validate_layout,
    varlen_attention,
)
from cp_varlen_attn._agree import group_device
from dist_testkit import run_checks

LENGTHS = [3, 90, 5, 40, 1]


class CountCollectives(TorchDispatchMode):
    """Records every c10d / functional-collective op that reaches the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in func.namespace and "wait" not in str(func) and "wrap" not in str(func):
            self.ops.append(str(func).split(".")[1])
        return func(*args, **(kwargs or {}))


def _calls(layout, rank, seed=0):
    """One attention, conv and GDN call on this rank's tokens, forward and backward."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    x = shard_sequence(torch.randn(1, t, 2, 8, generator=gen), layout, rank).requires_grad_()
    out = varlen_attention(x, x, x, layout, dist.group.WORLD)
    y = causal_conv1d(
        x.flatten(2), torch.randn(16, 4, generator=gen), layout=layout, group=dist.group.WORLD
    )
    g = -torch.rand(x.shape[:3], generator=gen)
    o, _ = gated_delta_rule(
        x, x, x, g, torch.rand(x.shape[:3], generator=gen), layout=layout, group=dist.group.WORLD
    )
    (out.sum() + y.sum() + o.sum()).backward()


def check_validated_layout_runs_no_validation_collective():
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = plan_cp_layout(cu_from_lengths(LENGTHS), world)
    validate_layout(layout, dist.group.WORLD, local_tokens=layout.local_len(rank))
    with CountCollectives() as hot:
        _calls(layout, rank)
    assert "allreduce_" not in hot.ops, hot.ops
    # the exchanges themselves: attention's K/V and GDN's prefix rounds (all-to-all, or an
    # all-gather when nearly everything is needed) and the conv halo (all-gather)
    assert hot.ops and set(hot.ops) <= {
        "all_to_all_single",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
    }, hot.ops
    # control: a fresh layout object is agreed once by its first call, then never again
    fresh = plan_cp_layout(cu_from_lengths(LENGTHS), world)
    with CountCollectives() as first:
        _calls(fresh, rank)
    assert first.ops.count("allreduce_") == 1, first.ops
    with CountCollectives() as again:
        _calls(fresh, rank)
    assert "allreduce_" not in again.ops, again.ops


def check_refusals_are_raised_on_every_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    cu = cu_from_lengths(LENGTHS)
    mine = plan_cp_layout(cu, world, strategy="contiguous" if rank == 0 else "balanced")
    with pytest.raises(ValueError, match="ranks passed different layouts"):
        validate_layout(mine, group)
    layout = plan_cp_layout(cu, world)
    wrong = layout.local_len(rank) - (1 if rank == 0 else 0)
    with pytest.raises(
        ValueError, match="tokens in the layout but got" if rank == 0 else r"rank\(s\) \[0\]"
    ):
        validate_layout(layout, group, local_tokens=wrong)
    with pytest.raises(
        ValueError, match=f"the layout is for {2 * world} CP ranks but the group has {world}"
    ):
        validate_layout(plan_cp_layout(cu, 2 * world), group)
    with pytest.raises(TypeError, match="layout must be a CPLayout, got list"):
        validate_layout([], group)
    validate_layout(layout, group, local_tokens=layout.local_len(rank))  # a good one passes


def check_agreement_runs_on_the_group_device():
    assert group_device(dist.group.WORLD) == torch.device("cpu")


CHECKS = [
    check_validated_layout_runs_no_validation_collective,
    check_refusals_are_raised_on_every_rank,
    check_agreement_runs_on_the_group_device,
]


@pytest.fixture(scope="module")
def report():
    return run_checks(CHECKS, 2, timeout=120)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_validation_at_cp2(report, check):
    report.assert_passed(check)


@pytest.mark.parametrize(
    ("backend", "device"),
    [("nccl", "cuda:0"), ("cpu:gloo,cuda:nccl", "cpu"), ("gloo", "cpu"), ("fake", "cpu")],
)
def test_group_device_follows_the_backend(monkeypatch, backend, device):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert group_device(None) == torch.device(device)


def test_without_a_group_only_a_one_rank_layout_passes():
    validate_layout(plan_cp_layout([0, 5], 1), None)
    with pytest.raises(ValueError, match="the layout is for 2 CP ranks but there is no group"):
        validate_layout(plan_cp_layout([0, 5], 2), None)
