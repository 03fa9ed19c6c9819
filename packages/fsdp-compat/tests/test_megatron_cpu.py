"""The REAL megatron-fsdp (0.6.x from the lock; nox runs this file again with 0.5.1) trained
through ``shard_model`` on CPU gloo ranks, against one process.

megatron-fsdp creates CUDA streams unconditionally; :func:`dist_testkit.cpu_cuda_streams` gives
it CPU stand-ins (exact on the CPU: its docstring says why), so its bucketing, element-range
sharding, reduce-scatters and optimizer-parameter swapping all run here. What stays with the GPU
test is megatron-fsdp's stream ordering on a real device.

The parity check trains the tiny transformer for three AdamW steps with two parameter groups
(weights decayed, the rest not, at another learning rate) and clipping, the optimizer built
before sharding and handed to ``shard_model``; every step compares the global loss, the full
gradients (:func:`fsdp_compat.full_tensor`), the clipped norm and the updated parameters with
one process training the unsharded model on the same global batch.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _models import Block, MoEBlock, MoEModel, TinyTransformer, batches, lm_loss
from torch.distributed.tensor import DTensor

from dist_testkit import assert_close, cpu_cuda_streams, make_mesh, named_check, run_checks
from fsdp_compat import (
    accumulating,
    clip_grad_norm,
    dcp_ready,
    finish_grad_sync,
    full_tensor,
    shard_model,
)

pytest.importorskip("megatron_fsdp")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test runs it for real")

STEPS, MAX_NORM = 3, 0.5


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """Two groups: matrices decayed at lr 0.05, vectors (norms, biases, gates) not, at 0.02."""
    params = dict(model.named_parameters())
    decayed = [n for n, p in params.items() if p.ndim >= 2]
    rest = [n for n in params if n not in decayed]
    return torch.optim.AdamW(
        [
            {"params": [params[n] for n in decayed], "weight_decay": 0.1},
            {"params": [params[n] for n in rest], "weight_decay": 0.0, "lr": 0.02},
        ],
        lr=0.05,
        foreach=False,
    )


def _reference(model, data):
    """One process: per step the global loss, the gradients, the norm, the parameters after."""
    model = copy.deepcopy(model)
    optimizer = _adamw(model)
    out = []
    for step_batches in data:
        optimizer.zero_grad()
        loss = sum(lm_loss(model, b) for b in step_batches) / len(step_batches)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append((loss.item(), grads, norm, params))
    return out


def _clip_step_and_compare(sharded, optimizer, step, ref_grads, ref_norm, ref_params) -> None:
    """The synced gradients (one on every rank, its shard empty or not: FSDP2's rule), the
    clipped norm and the parameters after the optimizer step, against one process's."""
    named = dict(sharded.module.named_parameters())
    assert named.keys() == ref_grads.keys()
    for name, p in named.items():
        assert isinstance(p, DTensor), (name, type(p))
        assert p.grad is not None, (name, p.to_local().shape)
        assert_close(full_tensor(p.grad), ref_grads[name], name=f"step {step} {name}.grad")
    norm = clip_grad_norm(sharded.parameters(), MAX_NORM)
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (step, norm, ref_norm)
    optimizer.step()
    for name, p in sharded.module.named_parameters():
        assert_close(full_tensor(p), ref_params[name], rtol=1e-4, atol=1e-6,
                     name=f"step {step} {name}")  # fmt: skip


def check_trains_like_one_process(overlap_grad_reduce: bool, moe: bool = False) -> None:
    """world 2 = dp 1 × cp 2 (the shard dims flattened), SUM reduction of loss shares; the
    gradient reductions asynchronous (megatron-fsdp's default) or not. The gradients are synced
    here to be read, and again by the optimizer's step: the second sync must change nothing.
    ``moe``: a model with experts (no EP), whose ``*.experts.*`` parameters megatron-fsdp shards
    over its expert mesh."""
    with cpu_cuda_streams():
        world, rank = dist.get_world_size(), dist.get_rank()
        mesh = make_mesh((1, world, 1), ("dp", "cp", "tp"))
        torch.manual_seed(0)
        model = MoEModel() if moe else TinyTransformer()
        data = batches(world, STEPS)
        reference = _reference(model, data)
        optimizer = _adamw(model)
        sharded = shard_model(model, mesh, backend="megatron-fsdp", shard_dims=("dp", "cp"),
                              unit_modules=[MoEBlock if moe else Block], optimizer=optimizer, grad_reduction="sum",
                              device=torch.device("cpu"),
                              overlap_grad_reduce=overlap_grad_reduce)  # fmt: skip
        for step, (ref_loss, ref_grads, ref_norm, ref_params) in enumerate(reference):
            optimizer.zero_grad()
            share = lm_loss(sharded, data[step][rank]) / world
            share.backward()
            finish_grad_sync(sharded)
            loss = share.detach().clone()
            dist.all_reduce(loss)
            assert_close(loss, torch.tensor(ref_loss), name=f"step {step} loss")
            _clip_step_and_compare(sharded, optimizer, step, ref_grads, ref_norm, ref_params)


def check_hsdp_accumulates_like_one_process(accum: int, auto_sync: bool) -> None:
    """HSDP at world 2: the ranks are replicas (``rep`` 2 x ``dp`` 1), each with ``accum``
    micro-batches per step, all but the last backward inside :func:`accumulating`; SUM
    reductions of loss shares. megatron-fsdp sums over the replicas on a backward marked last
    (``shard_model`` marks every one; ``accumulating`` unmarks), or on every backward with
    ``sync_model_each_microbatch`` (``auto_sync``; ``accumulating`` holds it off): the
    gradients, the clipped norm and the parameters equal one process's on the global batch of
    ``2 * accum``."""
    with cpu_cuda_streams():
        world, rank = dist.get_world_size(), dist.get_rank()
        mesh = make_mesh((world, 1, 1), ("rep", "dp", "tp"))
        torch.manual_seed(1)
        model = TinyTransformer()
        data = batches(world * accum, STEPS)
        reference = _reference(model, data)
        optimizer = _adamw(model)
        sharded = shard_model(model, mesh, backend="megatron-fsdp", shard_dims=("dp",),
                              replicate_dims=("rep",), unit_modules=[Block], optimizer=optimizer,
                              grad_reduction="sum", device=torch.device("cpu"),
                              sync_model_each_microbatch=auto_sync)  # fmt: skip
        for step, (_, ref_grads, ref_norm, ref_params) in enumerate(reference):
            optimizer.zero_grad()
            for i in range(accum):
                share = lm_loss(sharded, data[step][rank * accum + i]) / (world * accum)
                with accumulating(sharded) if i < accum - 1 else contextlib.nullcontext():
                    share.backward()
            finish_grad_sync(sharded)
            _clip_step_and_compare(sharded, optimizer, step, ref_grads, ref_norm, ref_params)


def _trained_megatron(mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The tiny transformer on megatron-fsdp after one AdamW step (optimizer state exists)."""
    torch.manual_seed(2)
    model = TinyTransformer()
    optimizer = _adamw(model)
    sharded = shard_model(model, mesh, backend="megatron-fsdp", shard_dims=("dp",),
                          unit_modules=[Block], optimizer=optimizer, grad_reduction="sum",
                          device=torch.device("cpu"))  # fmt: skip
    lm_loss(sharded, batches(dist.get_world_size(), 1)[0][dist.get_rank()]).backward()
    optimizer.step()
    return sharded, optimizer


def check_dcp_checkpoint_loads_into_fsdp2() -> None:
    """A DCP checkpoint of megatron-fsdp's model and optimizer (:func:`dcp_ready`) holds the
    global tensors: FSDP2 shards of a fresh model load exactly the same weights and Adam
    moments; a rank lacking a tensor the others hold is one error on every rank."""
    with cpu_cuda_streams():
        mesh = make_mesh((dist.get_world_size(), 1), ("dp", "tp"))
        sharded, optimizer = _trained_megatron(mesh)
        where = [tempfile.mkdtemp(prefix="fsdp_compat_dcp_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(where)
        try:
            _save_and_load(sharded, optimizer, where[0])
        finally:
            dist.barrier()  # every rank done with the folder before rank 0 removes it
            if dist.get_rank() == 0:
                shutil.rmtree(where[0])


def _save_and_load(sharded, optimizer, where: str) -> None:
    """:func:`check_dcp_checkpoint_loads_into_fsdp2`'s body, on the folder ``where``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    megatron_state, optim_state = get_state_dict(sharded.module, optimizer)
    dcp_ready(sharded, megatron_state, optim_state)
    dcp.save({"model": megatron_state, "optim": optim_state}, checkpoint_id=where)
    saved = {n: full_tensor(p) for n, p in sharded.module.named_parameters()}
    moments = {n: full_tensor(optimizer.state[p]["exp_avg"])
               for n, p in sharded.module.named_parameters()}  # fmt: skip

    fresh = TinyTransformer()
    shard_model(fresh, make_mesh((dist.get_world_size(),), ("dp",)))
    fresh_optimizer = _adamw(fresh)
    model_state, optim_state = get_state_dict(fresh, fresh_optimizer)
    dcp_ready(fresh, model_state, optim_state)  # FSDP2: nothing to do
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=where)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    for name, p in fresh.named_parameters():
        assert_close(full_tensor(p), saved[name], rtol=0, atol=0, name=name)
        exp_avg = full_tensor(fresh_optimizer.state[p]["exp_avg"])
        assert_close(exp_avg, moments[name], rtol=0, atol=0, name=f"{name} exp_avg")

    uneven = dict(megatron_state)
    if dist.get_rank() == 1:
        del uneven["head.weight"]
    with pytest.raises(ValueError, match=r"rank 1 lacks 1, e\.g\. \['head\.weight'\]"):
        dcp_ready(sharded, uneven)


def check_full_tensor_of_fsdp2_shards() -> None:
    """The same gather on FSDP2's ``torch.chunk`` shards (an empty one included)."""
    mesh = make_mesh((dist.get_world_size(),), ("dp",))
    torch.manual_seed(1)
    model = TinyTransformer()
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    shard_model(model, mesh)
    for name, p in model.named_parameters():
        assert_close(full_tensor(p), whole[name], rtol=0, atol=0, name=name)
    assert model.blocks[0].gate.to_local().numel() in (0, 1)  # one element over two ranks


def check_needs_a_tp_dim() -> None:
    mesh = make_mesh((dist.get_world_size(),), ("dp",))
    with pytest.raises(ValueError, match=r"needs a TP dim.*size 1.*\('dp',\)"):
        shard_model(TinyTransformer(), mesh, backend="megatron-fsdp")


CHECKS = [
    check_needs_a_tp_dim,
    check_full_tensor_of_fsdp2_shards,
    named_check("trains_like_one_process", check_trains_like_one_process, True),
    named_check("trains_like_one_process_sync_reduce", check_trains_like_one_process, False),
    named_check("moe_trains_like_one_process", check_trains_like_one_process, True, moe=True),
    named_check("hsdp_trains_like_one_process", check_hsdp_accumulates_like_one_process, 1, False),
    *(
        named_check(f"hsdp_accumulates_{sync}", check_hsdp_accumulates_like_one_process, 2, on)
        for sync, on in (("synced_each_backward", True), ("synced_last", False))
    ),
    check_dcp_checkpoint_loads_into_fsdp2,
]


@pytest.fixture(scope="module")
def report():
    return run_checks(CHECKS, 2, timeout=180)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_megatron_on_cpu_ranks(report, check):
    report.assert_passed(check)
