"""Single-process tests: input checks, backend resolution, the filter on plain empty tensors."""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging

import pytest
import torch
from optim_fakes import (
    EMPTY_GROUP_ERROR,
    EMPTY_TENSOR_ERROR,
    EmptyIntolerantAdamW,
    RawEmptyIntolerantAdamW,
)
from torch import nn
from torch.optim.lr_scheduler import StepLR

from dist_testkit import assert_close
from safe_optim import (
    OPTIMIZER_NAMES,
    accepts_empty_tensors,
    build_optimizer,
    declare_no_empty_tensors,
    local_numel,
)

HAS_TE = importlib.util.find_spec("transformer_engine") is not None


def _p(*shape: int, seed: int = 0) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


P, Q = _p(2, 3), _p(4, seed=1)

BAD_PARAMS = [
    ([], ValueError, "empty parameter list"),
    (iter([]), ValueError, "empty parameter list"),
    ([{"params": []}], ValueError, "param group 0 has no parameters"),
    ([{"params": [P]}, {"lr": 0.1}], TypeError, "param group 1 has no 'params' key"),
    ([P, 3.0], TypeError, "item 1 is a float, expected a torch.Tensor"),
    ([{"params": [P, "w"]}], TypeError, "param group 0: item 1 is a str"),
    ([{"params": "w"}], TypeError, "must be a tensor or an iterable of tensors, got str"),
    (nn.Linear(2, 2), TypeError, "iterable of tensors or of param-group dicts.*got Linear"),
    (P, TypeError, "got Parameter"),
    (None, TypeError, "got NoneType"),
    ([P, {"params": [Q]}], TypeError, "mixes param-group dicts"),
    ([P, Q, P], ValueError, r"shape \(2, 3\) appears more than once"),
    ([{"params": [P]}, {"params": P}], ValueError, "again in param group 1"),
]


@pytest.mark.parametrize(("params", "error", "match"), BAD_PARAMS)
def test_bad_params_raise_clearly(params, error, match):
    with pytest.raises(error, match=match):
        build_optimizer(params, "adamw")


def test_bad_optimizer_raises_clearly():
    with pytest.raises(ValueError, match=r"unknown optimizer name 'adamx'; expected one of adam,"):
        build_optimizer([P], "adamx")
    with pytest.raises(TypeError, match=r"optimizer must be a name or .* got int"):
        build_optimizer([P], 42)
    with pytest.raises(TypeError, match="expects an optimizer class or factory, got int"):
        declare_no_empty_tensors(42)
    with pytest.raises(TypeError, match=r"returned list, expected a torch\.optim\.Optimizer"):
        build_optimizer([P], declare_no_empty_tensors(lambda groups, **kw: list(groups)))


@pytest.mark.parametrize(
    ("name", "cls"),
    [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam), ("sgd", torch.optim.SGD)],
)
def test_torch_backends_are_built_unwrapped(name, cls):
    opt = build_optimizer([{"params": [P], "lr": 0.5}, {"params": [Q]}], name, lr=0.25)
    assert type(opt) is cls
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.25]
    assert set(OPTIMIZER_NAMES) == {"adam", "adamw", "sgd", "te_fused_adam"}


IMPLS = [{"foreach": False}, {"foreach": True}, {"fused": True}]


def _stepped_against_torch(device: str, impl: dict, ref_impl: dict) -> torch.optim.Optimizer:
    """``build_optimizer(..., "adamw", **impl)`` stepped three times next to torch's AdamW built
    with ``ref_impl``, an empty tensor (an FSDP2 shard) among the parameters; asserts the
    parameters equal bit for bit and returns the built optimizer."""
    mine = [nn.Parameter(_p(*s, seed=i).to(device)) for i, s in enumerate([(3, 2), (0, 4), (5,)])]
    theirs = [nn.Parameter(p.detach().clone()) for p in mine]
    opt = build_optimizer(mine, "adamw", lr=1e-2, weight_decay=0.1, **impl)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, **ref_impl)
    for step in range(3):
        for ps, o in ((mine, opt), (theirs, ref)):
            for i, p in enumerate(ps):
                p.grad = torch.full_like(p, 0.1 * (step + 1) * (i + 1)).sin()
            o.step()
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a, b)
    return opt


def _assert_adamw_unchanged(impl: dict, device: str) -> None:
    """Same class, same code path: bit-identical to constructing torch's AdamW directly."""
    assert type(_stepped_against_torch(device, impl, impl)) is torch.optim.AdamW


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_adamw_paths_unchanged(impl):
    _assert_adamw_unchanged(impl, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", IMPLS)
def test_torch_adamw_paths_unchanged_on_gpu(impl):
    _assert_adamw_unchanged(impl, "cuda")


def test_adamw_and_adam_pick_their_implementation_per_device(monkeypatch):
    """The rule, exercised on the CPU by listing it as CUDA is listed: "adamw" / "adam" get
    ``fused=True`` — the same steps as torch's fused AdamW, an empty tensor included — unless the
    caller picked an implementation; a device not listed (the CPU itself) keeps torch's
    default. (DTensors mixed with plain tensors: test_fsdp_dcp.py.)"""
    import safe_optim.build

    defaults = build_optimizer([P], "adamw").defaults  # the CPU: torch's default
    assert defaults["fused"] is None and defaults["foreach"] is None
    monkeypatch.setattr(safe_optim.build, "IMPLEMENTATION", {"cpu": "fused"})  # as CUDA is
    opt = _stepped_against_torch("cpu", {}, {"fused": True})
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert build_optimizer([P, Q], "adam").defaults["fused"] is True
    assert build_optimizer([P], "adamw", foreach=True).defaults["fused"] is None
    assert build_optimizer([{"params": [P], "foreach": False}], "adamw").defaults["fused"] is None
    assert build_optimizer([P], "sgd", lr=0.1).defaults.get("fused") is None
    ints = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    assert build_optimizer([P, ints], "adamw").defaults["fused"] is None  # not all floating
    monkeypatch.setattr(safe_optim.build, "IMPLEMENTATION", {"cpu": "foreach"})
    assert _stepped_against_torch("cpu", {}, {"foreach": True}).defaults["foreach"] is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_adamw_on_cuda_is_torchs_fused_adamw_and_equals_the_for_loop():
    opt = _stepped_against_torch("cuda", {}, {"fused": True})
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    # the fused kernel against torch's for-loop AdamW (an independent implementation)
    mine = [nn.Parameter(_p(64, 33, seed=3).cuda()), nn.Parameter(torch.empty(0, device="cuda"))]
    loop = [nn.Parameter(p.detach().clone()) for p in mine]
    fused = build_optimizer(mine, "adamw", lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(loop, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(5):
        for ps, o in ((mine, fused), (loop, ref)):
            for p in ps:
                p.grad = torch.full_like(p, 0.3 * (step + 1)).cos()
            o.step()
    assert_close(mine[0].cpu(), loop[0].cpu(), rtol=1e-6, atol=1e-7, name="fused vs for-loop")


def test_empty_tensor_declarations():
    assert accepts_empty_tensors("adamw") and accepts_empty_tensors(torch.optim.AdamW)
    assert not accepts_empty_tensors("te_fused_adam")
    assert accepts_empty_tensors(RawEmptyIntolerantAdamW)
    assert not accepts_empty_tensors(EmptyIntolerantAdamW)
    assert not accepts_empty_tensors(functools.partial(EmptyIntolerantAdamW, lr=1e-3))
    assert not accepts_empty_tensors(type("Sub", (EmptyIntolerantAdamW,), {}))

    def factory(groups, **kwargs):
        return RawEmptyIntolerantAdamW(groups, **kwargs)

    assert accepts_empty_tensors(factory)
    declared_partial = declare_no_empty_tensors(functools.partial(factory, lr=1e-3))
    assert not accepts_empty_tensors(declared_partial)
    assert accepts_empty_tensors(factory)

    @declare_no_empty_tensors
    def declared_factory(groups, **kwargs):
        return RawEmptyIntolerantAdamW(groups, **kwargs)

    assert not accepts_empty_tensors(functools.partial(declared_factory, lr=1e-3))
    # TransformerEngine's FusedAdam is recognised by module and name, without importing TE.
    te_like = type("FusedAdam", (torch.optim.Adam,), {})
    te_like.__module__ = "transformer_engine.pytorch.optimizers.fused_adam"
    assert not accepts_empty_tensors(te_like)
    with pytest.raises(ValueError, match="unknown optimizer name"):
        accepts_empty_tensors("lamb")


@pytest.mark.skipif(
    HAS_TE, reason="transformer_engine is installed: the missing-package error cannot occur"
)
def test_te_fused_adam_missing_names_the_package():
    with pytest.raises(
        ImportError, match=r"optimizer='te_fused_adam' needs .*transformer-engine\[pytorch\]"
    ):
        build_optimizer([P], "te_fused_adam", lr=1e-3)


def _groups(params):
    a, e0, e1, b = params
    return [
        {"params": [a, e0], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [e1], "lr": 3e-2},
        {"params": [b], "lr": 2e-2, "weight_decay": 0.0},
    ]


def _fresh():
    return [_p(3, 2, seed=5), _p(0, 3, seed=6), _p(0, seed=7), _p(4, seed=8)]


def _run(params, opt, sched, steps, start=0):
    for step in range(start, start + steps):
        for i, p in enumerate(params):
            p.grad = (torch.arange(p.numel(), dtype=p.dtype).view_as(p) * 0.3 + step + i).cos()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_without_filter_the_intolerant_backend_fails():
    params = _fresh()
    opt = build_optimizer(_groups(params), RawEmptyIntolerantAdamW)
    with pytest.raises(RuntimeError, match=EMPTY_TENSOR_ERROR):
        _run(params, opt, StepLR(opt, 1), 1)
    opt = RawEmptyIntolerantAdamW([{"params": []}, {"params": [_p(2, seed=10)]}])
    with pytest.raises(RuntimeError, match=EMPTY_GROUP_ERROR):
        opt.step()


def test_filter_matches_adamw_and_keeps_groups(caplog):
    params = _fresh()
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    with caplog.at_level(logging.INFO, logger="safe_optim"):
        opt = build_optimizer(_groups(params), EmptyIntolerantAdamW, betas=(0.8, 0.9))
    assert "rank 0: EmptyIntolerantAdamW leaves out 2 of 4 parameters" in caplog.text
    assert "param groups [1] keep nothing on this rank" in caplog.text
    assert isinstance(opt, EmptyIntolerantAdamW)
    ref = torch.optim.AdamW(_groups(ref_params), betas=(0.8, 0.9))
    sched, ref_sched = StepLR(opt, 2, gamma=0.5), StepLR(ref, 2, gamma=0.5)
    _run(params, opt, sched, 5)
    _run(ref_params, ref, ref_sched, 5)
    for i, (a, b) in enumerate(zip(params, ref_params, strict=True)):
        assert_close(a, b, name=f"param {i}")
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1, 1]
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    assert [g["lr"] for g in opt.param_groups] == [1e-2 / 4, 3e-2 / 4, 2e-2 / 4]
    assert opt.state[params[1]] == {} and opt.state[params[2]] == {}
    assert set(opt.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_state_dict_round_trip_resumes_bit_identically():
    params = _fresh()
    opt = build_optimizer(_groups(params), EmptyIntolerantAdamW)
    sched = StepLR(opt, 2, gamma=0.5)
    _run(params, opt, sched, 3)
    # state_dict() shares the live state tensors: copy it, as writing it to disk would.
    saved = copy.deepcopy({"optim": opt.state_dict(), "sched": sched.state_dict()})
    saved_params = [p.detach().clone() for p in params]
    _run(params, opt, sched, 3, start=3)

    resumed = [nn.Parameter(p.clone()) for p in saved_params]
    opt2 = build_optimizer(_groups(resumed), EmptyIntolerantAdamW)
    sched2 = StepLR(opt2, 2, gamma=0.5)
    opt2.load_state_dict(saved["optim"])
    sched2.load_state_dict(saved["sched"])
    _run(resumed, opt2, sched2, 3, start=3)
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)


def test_add_param_group_filters_too():
    params = _fresh()
    opt = build_optimizer([{"params": params[:1]}], EmptyIntolerantAdamW, lr=1e-2)
    opt.add_param_group({"params": params[1:], "lr": 1e-3})
    _run(params, opt, StepLR(opt, 1), 2)
    assert local_numel(params[1]) == 0 and opt.state[params[1]] == {}
    assert opt.state[params[3]]["step"] == 2


def test_step_hooks_run_once_per_step_after_load_state_dict():
    # torch's AdamW itself (declared through a partial): a subclass whose step calls a hooked
    # super().step() would run the hooks twice on its own, filter or not.
    params = _fresh()
    opt = build_optimizer(
        _groups(params), declare_no_empty_tensors(functools.partial(torch.optim.AdamW))
    )
    assert type(opt).__mro__[2] is torch.optim.AdamW
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(len(o.param_groups)))
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    # the hooks see what the backend steps: the two groups that keep parameters here
    assert calls == [2, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_TE, reason="needs transformer_engine (extra 'te')")
def test_te_fused_adam_on_gpu_skips_empty_tensors_and_matches_adamw():
    def make(values=None):
        g = torch.Generator().manual_seed(11)
        shapes = [(64, 32), (0,), (0, 32), (7,)]
        values = values or [torch.randn(*s, generator=g) for s in shapes]
        return [nn.Parameter(v.detach().clone().cuda()) for v in values]

    def groups(ps):  # group 1 holds only an empty tensor
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:3]}, {"params": ps[3:]}]

    def set_grads(ps, step):
        for i, p in enumerate(ps):
            ramp = torch.arange(p.numel(), device="cuda", dtype=p.dtype).view_as(p)
            p.grad = (ramp * 0.01 + step + i).cos()

    params, ref_params = make(), make()
    opt = build_optimizer(groups(params), "te_fused_adam", lr=1e-2, weight_decay=0.0)
    ref = torch.optim.AdamW(groups(ref_params), lr=1e-2, weight_decay=0.0)
    sched, ref_sched = StepLR(opt, 2, gamma=0.5), StepLR(ref, 2, gamma=0.5)
    for step in range(4):
        for ps, o, s in ((params, opt, sched), (ref_params, ref, ref_sched)):
            set_grads(ps, step)
            o.step()
            o.zero_grad()
            s.step()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(params, ref_params, strict=True)):
        assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-6, name=f"param {i}")

    resumed = make([p.cpu() for p in params])
    opt2 = build_optimizer(groups(resumed), "te_fused_adam", lr=1e-2, weight_decay=0.0)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for ps, o in ((params, opt), (resumed, opt2)):
        set_grads(ps, 4)
        o.step()
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)
