"""FSDP2 through ``shard_model`` on real gloo ranks (world 2 and 4), one launch per world.

Every parity check trains the sharded model for several Adam steps and compares, per step, the
loss averaged over ranks, the full (gathered) gradients and the updated parameters with one
process training the unsharded model on the mean loss over the data ranks' batches.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _models import (
    Block,
    MoEModel,
    TinyTransformer,
    TPModel,
    batches,
    dp_cp_mesh,
    lm_loss,
    make_optimizer,
    reference_run,
)
from fp8_checks import check_frozen_fp8_gathered_as_bytes
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import fsdp_compat.fsdp2
from dist_testkit import assert_close, assert_grads_close, make_mesh, named_check, run_checks
from fsdp_compat import (
    MixedPrecision,
    clip_grad_norm,
    flatten_mesh,
    get_mesh_dim,
    release,
    shard_model,
)

STEPS = 3
# DCP's object collectives (gather/scatter of the save plan) go through numpy.
HAVE_NUMPY = importlib.util.find_spec("numpy") is not None


def _train_and_compare(model, reference, data, data_rank, optimizer, rtol=1e-5, atol=1e-6):
    """Train ``model`` on ``data[step][data_rank]``; compare with ``reference_run``."""
    for step, (ref_loss, ref_grads, ref_params) in enumerate(reference_run(reference, data)):
        optimizer.zero_grad()
        loss = lm_loss(model, data[step][data_rank])
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        assert_close(mean / dist.get_world_size(), torch.tensor(ref_loss), rtol=rtol, atol=atol)
        assert_grads_close(model, ref_grads, rtol=rtol, atol=atol)
        optimizer.step()
        for name, p in model.named_parameters():
            assert_close(
                p, ref_params[name], rtol=10 * rtol, atol=10 * atol, name=f"step {step} {name}"
            )


def check_parity_dp_cp() -> list[int]:
    """shard_dims=("dp", "cp"): every rank is one data shard of a world-sized FSDP group."""
    mesh = dp_cp_mesh()
    torch.manual_seed(0)
    model = TinyTransformer()
    reference = copy.deepcopy(model)
    optimizer = make_optimizer(model)
    shard_model(model, mesh, shard_dims=("dp", "cp"), optimizer=optimizer)
    assert all(isinstance(b, FSDPModule) for b in model.blocks) and isinstance(model, FSDPModule)
    flat = get_mesh_dim(mesh, "dp_cp")
    for name, p in model.named_parameters():
        assert p.device_mesh is flat, f"{name} sharded on {p.device_mesh}, expected {flat}"
    data = batches(dist.get_world_size(), STEPS)
    _train_and_compare(model, reference, data, dist.get_rank(), optimizer)
    return [p.to_local().numel() for p in model.parameters()]


def _train_and_drop():
    """Two ``Linear`` units under a root without parameters of its own, sharded on a mesh of its
    own: one training forward and backward and one evaluation forward, released, its groups
    destroyed; a weak reference to it."""
    import weakref

    from torch.distributed.distributed_c10d import _world

    groups = set(_world.pg_map)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    mesh = make_mesh((dist.get_world_size(),), ("dp",))
    for unit in [*model, model]:
        fully_shard(unit, mesh=mesh)
    x = torch.randn(4, 8)
    model(x).square().mean().backward()
    with torch.no_grad():
        model(x)
    release(model)
    for new in [g for g in _world.pg_map if g not in groups]:
        dist.destroy_process_group(new)
    return weakref.ref(model)


def _threads() -> int:
    import gc
    import os

    gc.collect()
    return len(os.listdir("/proc/self/task"))


def check_release_frees_the_model_and_its_threads() -> None:
    """Released, a trained and evaluated model and its process groups' threads are freed with
    its last reference. (That FSDP2's run-time lists keep a model alive is shown on the trainer's
    model, whose runs leave no thread behind only through this release:
    ``integration/tests/test_run_resources.py``.)"""
    _train_and_drop()  # the autograd engine's threads start once
    before = _threads()
    model = _train_and_drop()
    after = _threads()
    assert model() is None and after == before, (model(), before, after)


def _naive_shard_mesh(mesh, dims):
    """The bug: a flattened dim looked up by name among ``mesh_dim_names`` is never found, so
    the code falls back to the first dim and CP drops out of the shard group."""
    name = "_".join(dims)
    return mesh[name] if name in mesh.mesh_dim_names else mesh[dims[0]]


def check_flattened_lookup_negative_control() -> None:
    mesh = dp_cp_mesh()
    world = dist.get_world_size()
    flat = flatten_mesh(mesh, ("dp", "cp"))
    assert flat.mesh_dim_names == ("dp_cp",) and flat.size() == world
    assert "dp_cp" not in mesh.mesh_dim_names  # the name check that misses it
    naive = _naive_shard_mesh(mesh, ("dp", "cp"))
    assert naive.size() == world // 2  # CP silently dropped
    assert get_mesh_dim(mesh, "dp_cp") is flat
    assert get_mesh_dim(mesh["cp"], "dp_cp") is flat  # found from a sibling submesh too
    assert flatten_mesh(mesh, ("dp", "cp")) is flat  # flattened once, then reused
    assert dist.get_process_group_ranks(flat.get_group()) == list(range(world))
    # Trained on the naive mesh, CP ranks' gradients are never averaged: parity fails.
    torch.manual_seed(0)
    model = TinyTransformer()
    reference = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block, mesh=naive)
    fully_shard(model, mesh=naive)
    data = batches(world, 1)
    loss = lm_loss(model, data[0][dist.get_rank()])
    loss.backward()
    with pytest.raises(AssertionError, match="differ"):
        assert_grads_close(model, reference_run(reference, data)[0][1])
    # ... and on the flattened mesh object it holds.
    torch.manual_seed(0)
    fixed = TinyTransformer()
    shard_model(fixed, mesh, shard_dims=("dp", "cp"))
    lm_loss(fixed, data[0][dist.get_rank()]).backward()
    assert_grads_close(fixed, reference_run(reference, data)[0][1])


def _recording(calls):
    @functools.wraps(fully_shard)
    def record(module, **kwargs):
        calls.append(kwargs)
        return fully_shard(module, **kwargs)

    return record


def check_optional_args_only_when_set() -> None:
    mesh = dp_cp_mesh()
    real = fsdp_compat.fsdp2.fully_shard
    try:
        unset: list[dict] = []
        fsdp_compat.fsdp2.fully_shard = _recording(unset)
        shard_model(TinyTransformer(), mesh, shard_dims=("dp", "cp"))
        assert len(unset) == 3  # two blocks, then the root
        for kwargs in unset:
            assert set(kwargs) == {"mesh"}, kwargs
        given: list[dict] = []
        fsdp_compat.fsdp2.fully_shard = _recording(given)
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_model(TinyTransformer(), mesh, shard_dims=("dp", "cp"), reshard_after_forward=False,
                    mixed_precision=mp)  # fmt: skip
        expected = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for kwargs in given:
            assert kwargs["reshard_after_forward"] is False
            assert kwargs["mp_policy"] == expected
            assert kwargs["mesh"] is get_mesh_dim(mesh, "dp_cp")
    finally:
        fsdp_compat.fsdp2.fully_shard = real


def check_mixed_precision_bf16() -> None:
    """bf16 compute, fp32 reduce: close to the fp32 reference within bf16 rounding."""
    mesh = dp_cp_mesh()
    torch.manual_seed(0)
    model = TinyTransformer()
    reference = copy.deepcopy(model)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_model(model, mesh, shard_dims=("dp", "cp"), mixed_precision=mp)
    data = batches(dist.get_world_size(), 1)
    tokens = data[0][dist.get_rank()]
    assert model(tokens[:, :-1]).dtype == torch.bfloat16
    loss = lm_loss(model, tokens)
    loss.backward()
    ref_loss, ref_grads, _ = reference_run(reference, data)[0]
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    assert_close(mean / dist.get_world_size(), torch.tensor(ref_loss), rtol=2e-2, atol=2e-2)
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        assert_close(p.grad, ref_grads[name], rtol=0.1, atol=2e-2, name=f"{name}.grad")


def check_fsdp_tp() -> None:
    """2×2 ("dp", "tp"): colwise/rowwise TP DTensors, FSDP over dp composes with them."""
    mesh = make_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = TPModel()
    reference = copy.deepcopy(model)
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    parallelize_module(model.block, mesh["tp"], plan)
    optimizer = make_optimizer(model)
    shard_model(model, mesh, shard_dims=("dp",), optimizer=optimizer)
    fc2 = model.block.fc2.weight
    assert fc2.device_mesh.mesh_dim_names == ("dp", "tp"), fc2.device_mesh
    assert fc2.placements == (Shard(0), Shard(1)), fc2.placements
    dp_rank = mesh["dp"].get_local_rank()
    _train_and_compare(model, reference, batches(2, STEPS), dp_rank, optimizer)


def check_fsdp_ep() -> None:
    """2×2 ("dp", "ep"): expert weights Shard(0) on "ep"; shard_dims=("dp", "ep") shards the
    dense parameters over all 4 ranks and the experts over "dp" only."""
    mesh = make_mesh((2, 2), ("dp", "ep"))
    torch.manual_seed(0)
    model = MoEModel()
    reference = copy.deepcopy(model)
    experts = model.moe.experts
    experts.w_EHH = torch.nn.Parameter(
        distribute_tensor(experts.w_EHH.detach(), mesh["ep"], [Shard(0)])
    )
    optimizer = make_optimizer(model)
    shard_model(model, mesh, shard_dims=("dp", "ep"), optimizer=optimizer)
    w = experts.w_EHH
    assert w.device_mesh.mesh_dim_names == ("dp", "ep"), w.device_mesh
    assert [p.dim for p in w.placements] == [0, 0], w.placements  # dp: (strided) dim 0, ep: dim 0
    assert model.moe.router.weight.device_mesh is get_mesh_dim(mesh, "dp_ep")
    dp_rank = mesh["dp"].get_local_rank()
    _train_and_compare(model, reference, batches(2, STEPS), dp_rank, optimizer)


def check_hsdp() -> None:
    """2×2 ("rep", "dp"): replicate over "rep", shard over "dp"; every rank its own data."""
    mesh = make_mesh((2, 2), ("rep", "dp"))
    torch.manual_seed(0)
    model = TinyTransformer()
    reference = copy.deepcopy(model)
    optimizer = make_optimizer(model)
    shard_model(model, mesh, shard_dims=("dp",), replicate_dims=("rep",), optimizer=optimizer)
    w = model.head.weight
    assert w.device_mesh.mesh_dim_names == ("rep", "dp"), w.device_mesh
    data = batches(dist.get_world_size(), STEPS)
    _train_and_compare(model, reference, data, dist.get_rank(), optimizer)


def check_hsdp_sum_reduction() -> None:
    """grad_reduction="sum" under HSDP (replicate "rep" x shard "dp"): each rank backpropagates
    its SHARE of the mean loss (its loss / world) and every reduction, the reduce-scatter and
    the replicate all-reduce, sums: the gradients are the one-process mean's. (With the default
    "mean" the same shares would give gradients world times too small.)"""
    mesh = make_mesh((2, 2), ("rep", "dp"))
    torch.manual_seed(0)
    model = TinyTransformer()
    reference = copy.deepcopy(model)
    optimizer = make_optimizer(model)
    shard_model(model, mesh, shard_dims=("dp",), replicate_dims=("rep",), optimizer=optimizer,
                grad_reduction="sum")  # fmt: skip
    data = batches(dist.get_world_size(), 1)
    share = lm_loss(model, data[0][dist.get_rank()]) / dist.get_world_size()
    share.backward()
    _, ref_grads, _ = reference_run(reference, data)[0]
    assert_grads_close(model, ref_grads, rtol=1e-5, atol=1e-6)


def check_expert_mesh_and_clip() -> None:
    """EP modules on a mesh of their own root (``expert_mesh=``): the experts' EP dim takes
    ranks {0, 2} / {1, 3}, across the dense mesh's rows [[0, 1], [2, 3]], so it is no dim of the
    dense mesh. Dense parameters: HSDP over the dense mesh; experts: FSDP over the expert
    mesh's "efsdp" dim. Then ``clip_grad_norm`` over parameters on three meshes equals
    ``torch.nn.utils.clip_grad_norm_`` of the one-process gradients."""
    dense = make_mesh((2, 2), ("rep", "dp"))
    expert = torch.distributed.device_mesh.DeviceMesh(
        "cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("efsdp", "ep")
    )
    torch.manual_seed(0)
    model = MoEModel()
    reference = copy.deepcopy(model)
    experts = model.moe.experts
    experts.w_EHH = torch.nn.Parameter(
        distribute_tensor(experts.w_EHH.detach(), expert["ep"], [Shard(0)])
    )
    shard_model(model, dense, shard_dims=("dp",), replicate_dims=("rep",),
                expert_mesh=expert["efsdp"])  # fmt: skip
    assert experts.w_EHH.device_mesh.mesh_dim_names == ("efsdp", "ep")
    data = batches(2, 1)  # the EP peers {0, 2} and {1, 3} hold the same rows
    lm_loss(model, data[0][expert["efsdp"].get_local_rank()]).backward()
    _, ref_grads, _ = reference_run(reference, data)[0]
    assert_grads_close(model, ref_grads, rtol=1e-5, atol=1e-6)
    grads = [g.clone() for g in ref_grads.values()]
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ref_params, grads, strict=True):
        p.grad = g
    expected = float(torch.nn.utils.clip_grad_norm_(ref_params, 0.1))
    names = [n for n, _ in reference.named_parameters()]
    said = []  # DTensor's "N sequential all_reduce operations ... inconsistent results" notice
    notice = logging.Handler()
    notice.emit = said.append
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(notice)
    try:
        norm = clip_grad_norm(model.parameters(), 0.1)
    finally:
        logging.getLogger("torch.distributed.tensor._redistribute").removeHandler(notice)
    assert not said, [r.getMessage() for r in said]
    assert abs(norm - expected) <= 1e-5 * expected, (norm, expected)
    assert_grads_close(model, {n: p.grad for n, p in zip(names, ref_params, strict=True)},
                       rtol=1e-5, atol=1e-7)  # fmt: skip


def check_dcp_roundtrip(path: str) -> None:
    """A DCP checkpoint of the dp×cp-sharded model restores its parameters exactly."""
    mesh = dp_cp_mesh()
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = make_optimizer(model)
    shard_model(model, mesh, shard_dims=("dp", "cp"), optimizer=optimizer)
    data = batches(dist.get_world_size(), 2)
    lm_loss(model, data[0][dist.get_rank()]).backward()
    optimizer.step()
    saved = {n: p.full_tensor() for n, p in model.named_parameters()}
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    optimizer.zero_grad()
    lm_loss(model, data[1][dist.get_rank()]).backward()
    optimizer.step()
    assert any(not torch.equal(p.full_tensor(), saved[n]) for n, p in model.named_parameters())
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        assert_close(p, saved[name], rtol=0, atol=0, name=name)


def check_bad_inputs() -> None:
    mesh = dp_cp_mesh()
    cases = [
        (dict(unit_modules=["Blok"]), ValueError, r"\['Blok'\] match no submodule"),
        (dict(shard_dims=("dp", "xx")), ValueError, r"\['xx'\] are not dims of the root mesh"),
        (dict(shard_dims=()), ValueError, "at least one mesh dim"),
        (dict(backend="ddp"), ValueError, "backend must be one of"),
        (dict(shard_dims=("dp",), replicate_dims=("dp",)), ValueError, "overlap"),
        (dict(mixed_precision=torch.bfloat16), TypeError, "fsdp_compat.MixedPrecision"),
        (dict(report_nan=True), ValueError, "megatron-fsdp options"),
        (dict(not_an_option=1), TypeError, r"\['not_an_option'\] are not fully_shard arguments"),
        (
            dict(grad_reduction="avg"),
            ValueError,
            r"grad_reduction must be one of \('mean', 'sum'\)",
        ),
        (dict(expert_mesh="ep"), TypeError, "expert_mesh must be a 1-D or 2-D DeviceMesh"),
        (dict(backend="megatron-fsdp", expert_mesh=mesh), ValueError, "is an FSDP2 option"),
    ]
    for kwargs, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            shard_model(TinyTransformer(), mesh, **kwargs)
    bare = torch.nn.Sequential(Block())
    with pytest.raises(ValueError, match="has no _no_split_modules"):
        shard_model(bare, mesh)
    with pytest.raises(ValueError, match="not dims of the root mesh"):
        flatten_mesh(mesh, ("dp_cp", "dp"))
    with pytest.raises(ValueError, match="mesh has no dim 'tp'"):
        get_mesh_dim(mesh, "tp")
    # Experts next to ordinary parameters cannot get one FSDP group.
    model = TinyTransformer()
    block = model.blocks[0]
    block.proj.weight = torch.nn.Parameter(
        distribute_tensor(block.proj.weight.detach(), mesh["cp"], [Shard(0)])
    )
    with pytest.raises(
        ValueError, match=r"blocks.0.proj holds EP-sharded parameters \['weight'\] .* next to"
    ):
        shard_model(model, mesh, ep_dim="cp")


def _checks(world: int, path: str) -> list:
    common = [
        # first: the models of the checks below are not released, and they hold their meshes
        check_release_frees_the_model_and_its_threads,
        check_parity_dp_cp,
        check_flattened_lookup_negative_control,
        check_optional_args_only_when_set,
        check_mixed_precision_bf16,
        check_bad_inputs,
        check_frozen_fp8_gathered_as_bytes,
    ]
    if HAVE_NUMPY:
        common.append(named_check("check_dcp_roundtrip", check_dcp_roundtrip, path))
    at_four = [check_fsdp_tp, check_fsdp_ep, check_hsdp, check_hsdp_sum_reduction,
               check_expert_mesh_and_clip]  # fmt: skip
    return common + (at_four if world == 4 else [])


CHECK_NAMES = {world: [c.__name__ for c in _checks(world, "")] for world in (2, 4)}
ALL_NAMES = [*CHECK_NAMES[4], *([] if HAVE_NUMPY else ["check_dcp_roundtrip"])]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def report(request):
    with tempfile.TemporaryDirectory() as path:
        yield run_checks(_checks(request.param, path), request.param, timeout=120)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_fsdp2(report, name):
    if name == "check_dcp_roundtrip" and not HAVE_NUMPY:
        pytest.skip("torch.distributed.checkpoint needs numpy for its object collectives")
    if name not in CHECK_NAMES[report.world_size]:
        pytest.skip(f"{name} needs a 2×2 mesh (world 4)")
    report.assert_passed(name)


def test_parity_leaves_some_ranks_empty(report):
    """Some parameters are smaller than the world size: at world 4 some local shards are empty."""
    numels = report.assert_passed(check_parity_dp_cp)
    if report.world_size == 4:
        assert any(0 in per_param for per_param in zip(*numels, strict=True))
