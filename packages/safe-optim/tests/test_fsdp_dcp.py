"""Multi-rank (gloo) tests: FSDP2 shards with empty local parts, an empty-intolerant backend,
LR schedules, and DCP optimizer checkpoints at world 2 and 4 (one launch per world).

Model: ``proj`` Linear(3→4) (weight 4×3, bias 4), ``scale`` (3,), ``gate`` (1,). FSDP2 shards
dim 0 like ``torch.chunk``: at world 2 ``gate`` is empty on rank 1; at world 4 ``gate`` is empty
on ranks 1–3 and ``scale`` on rank 3, so param group 2 (``gate``) keeps nothing on those ranks
and group 1 (``scale``) nothing on rank 3. The reference is a single-process torch AdamW on the
unsharded model over the whole batch (each rank's mean over an equal slice, averaged by FSDP2,
equals the whole batch's mean).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from optim_fakes import EMPTY_TENSOR_ERROR, EmptyIntolerantAdamW, RawEmptyIntolerantAdamW
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import StepLR

from dist_testkit import assert_close, full, make_mesh, run_checks
from safe_optim import build_optimizer, local_numel

BATCH = 8
STEPS_BEFORE_SAVE = 2
STEPS_AFTER_SAVE = 3
GROUP_OPTIONS = (
    {"lr": 1e-2, "weight_decay": 0.1},
    {"lr": 2e-2, "weight_decay": 0.0},
    {"lr": 5e-2, "weight_decay": 0.01},
)
ADAM_KW = {"betas": (0.9, 0.95), "eps": 1e-8}
CKPT_ENV = "SAFE_OPTIM_TEST_CKPT"


class Tiny(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(3, 4)
        for p in self.proj.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.5
        self.scale = nn.Parameter(1 + 0.3 * torch.randn(3, generator=g))
        self.gate = nn.Parameter(torch.randn(1, generator=g))

    def forward(self, x_B3: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x_B3 * self.scale)) * self.gate


def param_groups(model: nn.Module) -> list[dict]:
    by_name = dict(model.named_parameters())
    names = (["proj.weight", "proj.bias"], ["scale"], ["gate"])
    return [
        {"params": [by_name[n] for n in ns], **o}
        for ns, o in zip(names, GROUP_OPTIONS, strict=True)
    ]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 3, generator=g), torch.randn(BATCH, 4, generator=g)


def train(model, opt, sched, start: int, steps: int, sharded: bool) -> None:
    for step in range(start, start + steps):
        x_B3, y_B4 = batch(step)
        if sharded:
            x_B3 = x_B3.chunk(dist.get_world_size())[dist.get_rank()]
            y_B4 = y_B4.chunk(dist.get_world_size())[dist.get_rank()]
        ((model(x_B3) - y_B4) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def sharded_setup(seed: int, backend=EmptyIntolerantAdamW):
    model = Tiny(seed)
    fully_shard(model, mesh=make_mesh((dist.get_world_size(),), ("dp",)))
    opt = build_optimizer(param_groups(model), backend, **ADAM_KW)
    return model, opt, StepLR(opt, step_size=2, gamma=0.5)


def n_empty_local(model: nn.Module) -> int:
    return sum(local_numel(p) == 0 for p in model.parameters())


def full_optim_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every rank gathers every moment (the same collectives on every rank, empty state or not)."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            local = state[key].to_local() if key in state else torch.zeros_like(p.to_local())
            out[f"{name}.{key}"] = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            ).full_tensor()
        step = state["step"] if "step" in state else torch.tensor(-1.0)
        out[f"{name}.step"] = step.clone()
    return out


def checkpoint_state(model, opt, sched) -> dict:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt),
        "sched": sched.state_dict(),
    }


def load_checkpoint(model, opt, sched, path: Path) -> None:
    state = checkpoint_state(model, opt, sched)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    sched.load_state_dict(state["sched"])


def assert_state_equal(model, loaded: dict, saved: dict) -> None:
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[f"{name}.{key}"], saved[f"{name}.{key}"]), f"{name}.{key}"
        if local_numel(p) > 0:  # a left-out parameter holds no state on this rank
            assert torch.equal(loaded[f"{name}.step"], saved[f"{name}.step"]), f"{name}.step"


# ---- checks (each runs on every rank of one launch) ----


def check_parity_with_single_process_adamw() -> int:
    model, opt, sched = sharded_setup(seed=0)
    ref = Tiny(seed=0)
    ref_opt = torch.optim.AdamW(param_groups(ref), **ADAM_KW)
    ref_sched = StepLR(ref_opt, step_size=2, gamma=0.5)
    steps = STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE
    train(model, opt, sched, 0, steps, sharded=True)
    train(ref, ref_opt, ref_sched, 0, steps, sharded=False)
    for name, p in model.named_parameters():
        assert_close(full(p), ref.get_parameter(name), rtol=1e-5, atol=1e-6, name=name)
    # Every rank keeps the three groups in order, all parameters listed, and the schedule
    # reached every group (2 halvings in 5 steps), including groups that skip the step here.
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1, 1]
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs == [o["lr"] / 4 for o in GROUP_OPTIONS] == [g["lr"] for g in ref_opt.param_groups]
    return n_empty_local(model)


def check_without_filter_empty_shards_fail() -> int:
    """Negative control: the same backend, undeclared, gets the empty shards and fails on every
    rank that has one; all ranks agree on the count before anyone asserts."""
    model, opt, _ = sharded_setup(seed=0, backend=RawEmptyIntolerantAdamW)
    x_B3, y_B4 = batch(0)
    ((model(x_B3) - y_B4) ** 2).mean().backward()
    try:
        opt.step()
        failed = 0
    except RuntimeError as err:
        assert EMPTY_TENSOR_ERROR in str(err), err
        failed = 1
    failures = torch.tensor([failed])
    dist.all_reduce(failures)
    assert failed == int(n_empty_local(model) > 0)
    return int(failures)


def check_dcp_resume_bit_identical() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    root = Path(os.environ[CKPT_ENV])
    path = root / f"world{world}"
    model, opt, sched = sharded_setup(seed=0)
    train(model, opt, sched, 0, STEPS_BEFORE_SAVE, sharded=True)
    dcp.save(checkpoint_state(model, opt, sched), checkpoint_id=path)
    saved_state = full_optim_state(model, opt)
    train(model, opt, sched, STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE, sharded=True)
    uninterrupted = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(
            {"params": uninterrupted, "state": saved_state}, root / f"expected_world{world}.pt"
        )
    dist.barrier()

    model2, opt2, sched2 = sharded_setup(seed=1)
    load_checkpoint(model2, opt2, sched2, path)
    assert_state_equal(model2, full_optim_state(model2, opt2), saved_state)
    train(model2, opt2, sched2, STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE, sharded=True)
    for name, p in model2.named_parameters():
        assert torch.equal(full(p), uninterrupted[name]), name
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]


def check_naive_dropping_does_not_round_trip() -> int:
    """Negative control for the design: dropping locally empty parameters from the groups
    themselves (group 2 becomes empty on some ranks) does not survive a DCP round trip: DCP keeps
    one rank's parameter list per group, and the ranks whose lists differ cannot map it back.
    Returns how many ranks failed (all ranks agree before asserting)."""
    path = Path(os.environ[CKPT_ENV]) / f"naive_world{dist.get_world_size()}"

    def naive_setup(seed: int):
        model = Tiny(seed)
        fully_shard(model, mesh=make_mesh((dist.get_world_size(),), ("dp",)))
        groups = [
            {**g, "params": [p for p in g["params"] if local_numel(p) > 0]}
            for g in param_groups(model)
        ]
        opt = torch.optim.AdamW(groups, **ADAM_KW)
        return model, opt, StepLR(opt, step_size=2, gamma=0.5)

    model, opt, sched = naive_setup(seed=0)
    train(model, opt, sched, 0, STEPS_BEFORE_SAVE, sharded=True)
    dcp.save(checkpoint_state(model, opt, sched), checkpoint_id=path)
    train(model, opt, sched, STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE, sharded=True)
    uninterrupted = {n: full(p).detach().clone() for n, p in model.named_parameters()}

    model2, opt2, sched2 = naive_setup(seed=1)
    failed = 0
    try:
        load_checkpoint(model2, opt2, sched2, path)
        for group in opt2.param_groups:
            assert "lr" in group, "a param group lost its options"
    except (ValueError, KeyError, RuntimeError, AssertionError):
        failed = 1
    failures = torch.tensor([failed])
    dist.all_reduce(failures)
    if int(failures) == 0:
        train(model2, opt2, sched2, STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE, sharded=True)
        same = all(torch.equal(full(p), uninterrupted[n]) for n, p in model2.named_parameters())
        assert not same, "naive dropping round-tripped: the negative control is not negative"
    return int(failures)


def check_dcp_reshard_world2_to_world4() -> None:
    """Load world 2's checkpoint at world 4 (other ranks leave out other parameters): the
    optimizer state arrives bit-identical, continued steps match world 2's uninterrupted run up
    to the reduction order of the gradient average (which differs between world sizes)."""
    root = Path(os.environ[CKPT_ENV])
    expected = torch.load(root / "expected_world2.pt")
    model, opt, sched = sharded_setup(seed=1)
    load_checkpoint(model, opt, sched, root / "world2")
    assert_state_equal(model, full_optim_state(model, opt), expected["state"])
    train(model, opt, sched, STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE, sharded=True)
    for name, p in model.named_parameters():
        assert_close(full(p), expected["params"][name], rtol=1e-5, atol=1e-6, name=name)


def check_adamw_implementation_per_kind_of_parameters() -> None:
    """``"adamw"`` with the CPU listed as CUDA is (``fused``), or with ``foreach``: over FSDP2's
    DTensors it takes that implementation; where DTensors and plain tensors mix (``proj``
    sharded, ``scale`` and ``gate`` not) the for-loop, since torch's foreach and fused ops refuse
    a list that mixes them (on CUDA, torch's own default too). Each run equals one process's
    for-loop AdamW (every rank trains on the whole batch, so the plain parameters' gradients
    need no averaging)."""
    import safe_optim.build

    listed = safe_optim.build.IMPLEMENTATION
    try:
        for implementation in ("foreach", "fused"):
            safe_optim.build.IMPLEMENTATION = {"cpu": implementation}
            for mixed in (False, True):
                model = Tiny(seed=0)
                mesh = make_mesh((dist.get_world_size(),), ("dp",))
                fully_shard(model.proj if mixed else model, mesh=mesh)
                opt = build_optimizer(param_groups(model), "adamw", **ADAM_KW)
                picked = {k: v for k in ("foreach", "fused") if (v := opt.defaults[k]) is not None}
                assert picked == ({"foreach": False} if mixed else {implementation: True}), picked
                ref = Tiny(seed=0)
                ref_opt = torch.optim.AdamW(param_groups(ref), foreach=False, **ADAM_KW)
                for m, o in ((model, opt), (ref, ref_opt)):
                    train(m, o, StepLR(o, step_size=2, gamma=0.5), 0, 3, sharded=False)
                for name, p in model.named_parameters():
                    expected = ref.get_parameter(name)
                    assert_close(full(p), expected, rtol=1e-5, atol=1e-6, name=name)
    finally:
        safe_optim.build.IMPLEMENTATION = listed


CHECKS = {
    2: [
        check_parity_with_single_process_adamw,
        check_adamw_implementation_per_kind_of_parameters,
        check_without_filter_empty_shards_fail,
        check_dcp_resume_bit_identical,
        check_naive_dropping_does_not_round_trip,
    ],
    4: [
        check_parity_with_single_process_adamw,
        check_without_filter_empty_shards_fail,
        check_dcp_resume_bit_identical,
        check_dcp_reshard_world2_to_world4,
    ],
}
EMPTY_PER_RANK = {2: [0, 1], 4: [0, 1, 1, 2]}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    env = {CKPT_ENV: str(root)}
    # world 4 reads world 2's checkpoint: launch in this order.
    return {world: run_checks(CHECKS[world], world, timeout=180, env=env) for world in (2, 4)}


CASES = [(w, c) for w in (2, 4) for c in CHECKS[w]]


@pytest.mark.parametrize(("world", "check"), CASES, ids=[f"w{w}-{c.__name__}" for w, c in CASES])
def test_rank_check(reports, world, check):
    results = reports[world].assert_passed(check)
    if check is check_parity_with_single_process_adamw:
        assert results == EMPTY_PER_RANK[world]
    if check is check_without_filter_empty_shards_fail:
        assert results == [world - 1] * world
    if check is check_naive_dropping_does_not_round_trip:
        assert len(set(results)) == 1, results  # every rank agreed on the failure count
