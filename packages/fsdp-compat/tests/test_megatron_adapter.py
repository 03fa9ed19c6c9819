"""The megatron-fsdp adapter against the REAL installed release (0.6.x from the lock; nox also
runs this file with 0.5.1 installed over it).

megatron-fsdp needs CUDA to run, so on CPU the entry point is replaced by a recorder that keeps
the real function's signature (``functools.wraps``): ``shard_model`` builds and "calls" it, and
the recorded keywords are bound to ``inspect.signature`` of the real function and checked value
by value. megatron-fsdp's own ``FSDPDistributedIndex`` then resolves the recorded mesh names on
a real gloo mesh, proving that the flattened dp×cp name reaches the full dp×cp group. The GPU
test at the end runs the real thing.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import socket

import pytest
import torch
import torch.distributed as dist
from _models import Block, TinyTransformer, TPModel, batches, lm_loss, make_optimizer, reference_run
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_compat.megatron
from dist_testkit import make_mesh, run_checks
from fsdp_compat import (
    BackendSignatureError,
    MixedPrecision,
    get_mesh_dim,
    megatron_tp_shape_bug,
    shard_model,
)

megatron_fsdp = pytest.importorskip("megatron_fsdp")
VERSION = megatron_fsdp.__version__
HAS_MAXPOOL = (
    "maxpool_double_buffer" in inspect.signature(megatron_fsdp.fully_shard_model).parameters
)


class _Recorded(Exception):
    """Raised by the recorder in place of running megatron-fsdp (which needs CUDA)."""


def _record(name: str, fake=None):
    """Replace ``megatron_fsdp.<name>`` by a recorder with the real (or ``fake``) signature."""
    real = getattr(megatron_fsdp, name)
    calls: list[dict] = []

    @functools.wraps(fake or real)
    def recorder(**kwargs):
        calls.append(kwargs)
        raise _Recorded

    setattr(megatron_fsdp, name, recorder)
    return real, calls


def _call(model, mesh, entry="fully_shard_model", fake=None, **kwargs) -> tuple[object, dict]:
    real, calls = _record(entry, fake)
    try:
        with pytest.raises(_Recorded):
            shard_model(model, mesh, backend="megatron-fsdp", **kwargs)
    finally:
        setattr(megatron_fsdp, entry, real)
    (recorded,) = calls
    return real, recorded


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def check_call_binds_real_signature() -> None:
    mesh = make_mesh((1, 1, 2, 1), ("rep", "dp", "cp", "tp"))
    model = TinyTransformer()
    mp = MixedPrecision(reduce_dtype=torch.bfloat16, main_grads_dtype=torch.float32)
    real, kw = _call(model, mesh, shard_dims=("dp", "cp"), replicate_dims=("rep",), tp_dim="tp",
                     mixed_precision=mp, report_nan=True, reshard_after_forward=False)  # fmt: skip
    bound = inspect.signature(real).bind(**kw)
    assert bound.arguments == kw
    flat = get_mesh_dim(mesh, "dp_cp")
    expected = {
        "module": model,
        "device_mesh": mesh,
        "dp_shard_dim": "dp_cp",
        "dp_outer_dim": "rep",
        "tp_dim": "tp",
        "fsdp_unit_modules": [Block],
        "zero_dp_strategy": "optim_grads",
        "mixed_precision_policy": megatron_fsdp.MixedPrecisionPolicy(
            main_params_dtype=torch.float32,
            main_grads_dtype=torch.float32,
            grad_comm_dtype=torch.bfloat16,
        ),
        "report_nan_in_param_grad": True,
    }
    hybrid = kw.pop("hybrid_fsdp_group")
    assert kw == expected, kw
    assert _ranks(hybrid) == _ranks(get_mesh_dim(mesh, "rep_dp_cp").get_group()) == [0, 1]
    # megatron-fsdp's own index resolves our names to the full dp×cp group.
    index = megatron_fsdp.FSDPDistributedIndex(
        device_mesh=kw["device_mesh"],
        dp_shard_dim=kw["dp_shard_dim"],
        dp_outer_dim=kw["dp_outer_dim"],
        tp_dim=kw["tp_dim"],
        hybrid_fsdp_group=hybrid,
    )
    assert _ranks(index.fsdp_group) == _ranks(flat.get_group()) == [0, 1]


def check_unset_options_are_omitted() -> None:
    mesh = make_mesh((1, 2, 1), ("dp", "cp", "tp"))
    model = TinyTransformer()
    real, kw = _call(model, mesh, shard_dims=("dp", "cp"))
    assert set(kw) == {"module", "device_mesh", "dp_shard_dim", "tp_dim", "fsdp_unit_modules"}, kw
    assert kw["tp_dim"] == "tp"  # the mesh's size-1 TP dim: megatron-fsdp needs one
    bound = inspect.signature(real).bind(**kw)
    bound.apply_defaults()
    assert bound.arguments["zero_dp_strategy"] == 3  # the release's own default stands


def check_optimizer_is_not_given_to_megatron() -> None:
    """With an optimizer the entry point is still ``fully_shard_model``: megatron-fsdp's
    ``fully_shard`` would regroup it and step it once (fsdp_compat.megatron_optim)."""
    mesh = make_mesh((2, 1), ("dp", "tp"))
    model = TinyTransformer()
    optimizer = make_optimizer(model)
    real, kw = _call(model, mesh, optimizer=optimizer,
                     unit_modules=["_models.Block"])  # a dotted class path  # fmt: skip
    inspect.signature(real).bind(**kw)
    assert "optimizer" not in kw and kw["dp_shard_dim"] == "dp"
    assert kw["fsdp_unit_modules"] == [Block]
    assert not optimizer.state


def check_release_specific_options() -> None:
    """0.6 added ``maxpool_double_buffer``: passed through on 0.6, refused (closed) on 0.5."""
    mesh = make_mesh((2, 1), ("dp", "tp"))
    if HAS_MAXPOOL:
        real, kw = _call(TinyTransformer(), mesh, maxpool_double_buffer=True)
        inspect.signature(real).bind(**kw)
        assert kw["maxpool_double_buffer"] is True
    else:
        with pytest.raises(BackendSignatureError, match=rf"{VERSION}.*\['maxpool_double_buffer'\]"):
            shard_model(
                TinyTransformer(), mesh, backend="megatron-fsdp", maxpool_double_buffer=True
            )
    # 0.5 added the all-gather groups; both supported releases take them.
    group = get_mesh_dim(mesh, "dp").get_group()
    real, kw = _call(TinyTransformer(), mesh, fsdp_group_ag=group, expt_fsdp_group_ag=group)
    inspect.signature(real).bind(**kw)
    assert kw["fsdp_group_ag"] is group and kw["expt_fsdp_group_ag"] is group


def check_sum_reduction_is_per_token_loss() -> None:
    """``grad_reduction="sum"`` → ``calculate_per_token_loss=True`` (in the 0.5.1 and 0.6.1
    sources: no gradient scaling factor, so ``ReduceOp.SUM``); a release without it fails
    closed."""
    mesh = make_mesh((2, 1), ("dp", "tp"))
    real, kw = _call(TinyTransformer(), mesh, grad_reduction="sum")
    inspect.signature(real).bind(**kw)
    assert kw["calculate_per_token_loss"] is True
    _, kw = _call(TinyTransformer(), mesh)
    assert "calculate_per_token_loss" not in kw  # "mean": the release's own averaging
    with pytest.raises(BackendSignatureError, match=r"\['calculate_per_token_loss'\]"):
        _call(TinyTransformer(), mesh, fake=_no_units_reduction, grad_reduction="sum")
    with pytest.raises(ValueError, match="set by shard_model itself"):
        shard_model(TinyTransformer(), mesh, backend="megatron-fsdp", calculate_per_token_loss=True)


def _no_units_reduction(module, device_mesh=None, dp_shard_dim=None, tp_dim=None,
                        fsdp_unit_modules=None):  # fmt: skip
    """An entry point without ``calculate_per_token_loss``."""


def _old_signature(module, device_mesh=None, dp_shard_dim=None, tp_dim=None, fsdp_unit_modules=None,
                   grad_reduce_in_fp32=False, preserve_fp32_weights=True,
                   check_for_nan_in_grad=False):  # fmt: skip
    """The shape of a <= 0.3 entry point: no mixed_precision_policy, old NaN flag."""


def _no_units(module, device_mesh=None, dp_shard_dim=None, tp_dim=None):
    """An entry point without the unit-module argument."""


def check_unknown_signature_fails_closed() -> None:
    mesh = make_mesh((2, 1), ("dp", "tp"))
    mp = MixedPrecision(reduce_dtype=torch.float32)
    with pytest.raises(BackendSignatureError, match=rf"{VERSION}.*\['mixed_precision_policy'\]"):
        _call(TinyTransformer(), mesh, fake=_old_signature, mixed_precision=mp)
    with pytest.raises(BackendSignatureError, match=rf"{VERSION}.*\['fsdp_unit_modules'\]"):
        _call(TinyTransformer(), mesh, fake=_no_units)
    # The old NaN flag is found by name when the release has only that one.
    _, kw = _call(TinyTransformer(), mesh, fake=_old_signature, report_nan=True)
    assert kw["check_for_nan_in_grad"] is True and "report_nan_in_param_grad" not in kw
    with pytest.raises(ValueError, match="set by shard_model itself"):
        shard_model(TinyTransformer(), mesh, backend="megatron-fsdp", dp_shard_dim="dp")


def _tp_model(mesh, plan):
    model = TPModel()
    parallelize_module(model.block, mesh["tp"], plan)
    return model


def check_tp_shape_bug_refused_before_collectives() -> None:
    mesh = make_mesh((1, 2), ("dp", "tp"))
    rowwise = _tp_model(mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    real, calls = _record("fully_shard_model")
    try:
        with pytest.raises(
            ValueError, match=rf"{VERSION}.*GLOBAL trailing shape.*block\.fc2\.weight"
        ):
            shard_model(rowwise, mesh, backend="megatron-fsdp", shard_dims=("dp",))
        assert calls == []
        assert "dp" not in mesh._flatten_mapping and not mesh._flatten_mapping  # nothing built
        colwise = _tp_model(mesh, {"fc1": ColwiseParallel()})
        with pytest.raises(_Recorded):
            shard_model(colwise, mesh, backend="megatron-fsdp", shard_dims=("dp",))
        assert calls[0]["tp_dim"] == "tp"  # derived from the TP DTensors
    finally:
        megatron_fsdp.fully_shard_model = real


CHECKS = [
    check_call_binds_real_signature,
    check_unset_options_are_omitted,
    check_optimizer_is_not_given_to_megatron,
    check_release_specific_options,
    check_unknown_signature_fails_closed,
    check_tp_shape_bug_refused_before_collectives,
    check_sum_reduction_is_per_token_loss,
]


@pytest.fixture(scope="module")
def report():
    return run_checks(CHECKS, 2, timeout=120)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_adapter(report, check):
    report.assert_passed(check)


def test_installed_release_has_tp_shape_bug():
    """Both published releases the suite runs against (0.5.1, 0.6.1) carry the bug."""
    reason = megatron_tp_shape_bug()
    assert reason is not None and VERSION in reason


def test_tp_shape_bug_detected_from_source(monkeypatch):
    """A release newer than the known-bad range is judged by its source."""
    monkeypatch.setattr(fsdp_compat.megatron, "_version", lambda: "9.9.9")
    reason = megatron_tp_shape_bug()
    assert reason is not None and "orig_param.shape[1:]" in reason  # the installed source has it
    buffer = __import__("megatron_fsdp.param_and_grad_buffer", fromlist=["x"])

    def fixed(local_tensor, param):
        local_shape = (-1, *local_tensor.shape[1:])
        return local_tensor.view(local_shape)

    monkeypatch.setattr(buffer, "make_fsdp_dtensor", fixed)
    assert megatron_tp_shape_bug() is None


def test_mixed_precision_mapping_errors():
    mp = MixedPrecision(output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no output cast"):
        mp.megatron_fields({torch.float32})
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"model's own dtype.*\['torch.float32'\]"):
        mp.megatron_fields({torch.float32})
    assert mp.megatron_fields({torch.bfloat16}) == {
        "main_params_dtype": torch.float32,
        "main_grads_dtype": None,
        "grad_comm_dtype": None,
    }
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        MixedPrecision(reduce_dtype=torch.int32)
    keep = MixedPrecision(param_dtype=torch.bfloat16, keep_dtype=lambda p: not p.requires_grad)
    with pytest.raises(ValueError, match=r"keep_dtype .* is an FSDP2 option"):
        keep.megatron_fields({torch.bfloat16})
    override = keep.to_fsdp2().param_dtype_override_fn
    frozen = torch.nn.Parameter(torch.zeros(2, dtype=torch.float8_e4m3fn), requires_grad=False)
    assert override(frozen) == torch.float8_e4m3fn  # gathered as stored
    assert override(torch.nn.Parameter(torch.zeros(2))) is None  # cast to param_dtype
    with pytest.raises(TypeError, match="keep_dtype must be a callable"):
        MixedPrecision(keep_dtype=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_train(port: int) -> list[tuple[float, float]]:
    """One NCCL rank on GPU 0: megatron-fsdp via shard_model vs the unsharded reference."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("dp", "cp", "tp"))
        torch.manual_seed(0)
        model = TinyTransformer().cuda()
        reference = copy.deepcopy(model)
        optimizer = make_optimizer(model)
        sharded = shard_model(model, mesh, backend="megatron-fsdp", shard_dims=("dp", "cp"),
                              optimizer=optimizer, report_nan=True)  # fmt: skip
        data = [[b.cuda() for b in step] for step in batches(1, 3)]
        losses = []
        for step, (ref_loss, _, _) in enumerate(reference_run(reference, data)):
            optimizer.zero_grad()
            loss = lm_loss(sharded, data[step][0])
            loss.backward()
            optimizer.step()
            losses.append((loss.item(), ref_loss))
        return losses
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_real_megatron_fsdp_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: megatron-fsdp runs on CUDA only")
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        losses = pool.apply(_gpu_train, (_free_port(),))
    for got, want in losses:
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), losses
