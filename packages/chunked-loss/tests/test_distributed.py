"""Multi-rank parity on gloo: vocab-parallel (TP=2, TP=4, uneven and empty shards, 2-D mesh) on
both paths (gradients in forward: 3 matmuls per chunk, counted; recompute), FSDP2-sharded
lm_head through LinearCrossEntropy, and global-token normalisation over DP ranks and
micro-batches. One launch per world size runs every check."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from _count import MatmulCounter
from _reference import make_inputs, reference
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from chunked_loss import LinearCrossEntropy, global_num_valid_tokens, linear_cross_entropy
from dist_testkit import assert_close, full, make_mesh, run_checks

TOL = {"rtol": 1e-4, "atol": 1e-5}


def _vocab_parallel_case(
    mesh, tp_dim, v, *, seed, bias, reduction, smoothing, ignore_frac=0.3, **path
):
    hidden, weight, b, labels = make_inputs(23, 8, v, seed=seed, bias=bias, ignore_frac=ignore_frac)
    placements = [Replicate()] * mesh.ndim
    placements[tp_dim] = Shard(0)
    w_dt = nn.Parameter(distribute_tensor(weight, mesh, placements))
    b_dt = nn.Parameter(distribute_tensor(b, mesh, placements)) if bias else None
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(
        h,
        w_dt,
        labels,
        bias=b_dt,
        chunk_size=5,
        reduction=reduction,
        label_smoothing=smoothing,
        **path,
    )
    grad_out = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed + 1))
    loss.backward(grad_out)
    ref_loss, ref_grads = reference(
        hidden,
        weight,
        labels,
        bias=b,
        reduction=reduction,
        label_smoothing=smoothing,
        grad_out=grad_out,
    )
    name = f"V={v} bias={bias} {reduction} eps={smoothing} {path}"
    assert_close(loss, ref_loss, name=f"loss {name}", **TOL)
    assert_close(h.grad, ref_grads[0], name=f"grad_hidden {name}", **TOL)
    assert_close(full(w_dt.grad), ref_grads[1], name=f"grad_weight {name}", **TOL)
    if bias:
        assert_close(full(b_dt.grad), ref_grads[2], name=f"grad_bias {name}", **TOL)
    return w_dt.to_local().shape[0]


def check_vocab_parallel_parity():
    """Every rank holds the same tokens; V is split unevenly (the last shard may be empty). Each
    case runs on both paths (gradients in forward for the scalar reductions, and recompute),
    with compiled and eager kernels in turn."""
    world = dist.get_world_size()
    mesh = make_mesh((world,), ("tp",))
    local_rows = []
    for i, (v, bias, reduction, smoothing) in enumerate(
        [
            (29, True, "mean", 0.0),
            (29, False, "sum", 0.1),
            (9, True, "none", 0.2),
            (3, True, "mean", 0.1),
            (32, False, "none", 0.0),
        ]
    ):
        case = {"seed": 10 + i, "bias": bias, "reduction": reduction, "smoothing": smoothing}
        for gif in (True, False) if reduction != "none" else (False,):
            rows = _vocab_parallel_case(
                mesh, 0, v, grad_in_forward=gif, compiled=(i + gif) % 2 == 0, **case
            )
        local_rows.append(rows)
    return local_rows


def check_vocab_parallel_three_matmuls():
    """Gradients in forward on the TP path: exactly 3 matmuls per chunk in the forward and none
    in the backward (recompute: 1 + 3), with the FLOPs of 3 (1 + 3) products of the shard, and
    the unsharded loss and gradients."""
    mesh = make_mesh((dist.get_world_size(),), ("tp",))
    hidden, weight, b, labels = make_inputs(23, 8, 29, seed=3, ignore_frac=0.3)
    valid = int((labels != -100).sum())
    chunks = -(-valid // 4)
    ref_loss, ref_grads = reference(hidden, weight, labels, bias=b)
    counts, flops = [], []
    for gif in (True, False):
        w_dt = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
        b_dt = nn.Parameter(distribute_tensor(b, mesh, [Shard(0)]))
        h = hidden.clone().requires_grad_()
        with MatmulCounter() as fwd:
            loss = linear_cross_entropy(
                h, w_dt, labels, bias=b_dt, chunk_size=4, grad_in_forward=gif, compiled=False
            )
        with MatmulCounter() as bwd:
            loss.backward()
        counts.append((fwd.count, bwd.count))
        flops.append((fwd.flops, bwd.flops))
        assert_close(loss, ref_loss, name=f"loss gif={gif}", **TOL)
        assert_close(h.grad, ref_grads[0], name=f"grad_hidden gif={gif}", **TOL)
        assert_close(full(w_dt.grad), ref_grads[1], name=f"grad_weight gif={gif}", **TOL)
        assert_close(full(b_dt.grad), ref_grads[2], name=f"grad_bias gif={gif}", **TOL)
    assert counts == [(3 * chunks, 0), (chunks, 3 * chunks)], (counts, chunks)
    # and exactly that work: each matmul is one [valid, H] x [H, V_r] product of this shard
    product = 2 * valid * 8 * w_dt.to_local().shape[0]
    assert flops == [(3 * product, 0), (product, 3 * product)], (flops, product)
    return counts


def check_vocab_parallel_all_ignored():
    mesh = make_mesh((dist.get_world_size(),), ("tp",))
    hidden, weight, _, labels = make_inputs(7, 4, 10, ignore_frac=1.0)
    w_dt = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, w_dt, labels, chunk_size=3)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(h.grad, torch.zeros_like(h))
    assert torch.equal(full(w_dt.grad), torch.zeros_like(weight))


def check_vocab_parallel_errors_are_agreed():
    """Only the last rank sees a bad label (then a bad CHUNKED_LOSS_CPU_MATMUL): every rank
    raises, nobody hangs."""
    world = dist.get_world_size()
    mesh = make_mesh((world,), ("tp",))
    hidden, weight, _, labels = make_inputs(6, 4, 13)
    if dist.get_rank() == world - 1:
        labels[0] = 13
    w_dt = distribute_tensor(weight, mesh, [Shard(0)])
    with pytest.raises(ValueError) as info:
        linear_cross_entropy(hidden, w_dt, labels)
    expected = "first 13" if dist.get_rank() == world - 1 else "another rank of the TP group"
    assert expected in str(info.value), str(info.value)
    labels[0] = 0
    # Only rank 0's hidden requires grad: auto mode would pick different paths (and different
    # collectives); every rank raises instead of hanging.
    h = hidden.clone().requires_grad_(dist.get_rank() == 0)
    with pytest.raises(ValueError, match="resolved grad_in_forward differently"):
        linear_cross_entropy(h, w_dt, labels)
    # A bad CHUNKED_LOSS_CPU_MATMUL on the last rank only: agreed like a bad input.
    if dist.get_rank() == world - 1:
        os.environ["CHUNKED_LOSS_CPU_MATMUL"] = "mkl"
    try:
        with pytest.raises(ValueError) as info:
            linear_cross_entropy(hidden, w_dt, labels)
    finally:
        os.environ.pop("CHUNKED_LOSS_CPU_MATMUL", None)
    expected = "'mkl'" if dist.get_rank() == world - 1 else "another rank of the TP group"
    assert expected in str(info.value), str(info.value)
    dist.barrier()


def check_vocab_parallel_2d_mesh():
    """(dp, tp) mesh: weight Replicate over dp, Shard(0) over tp; tokens differ per dp rank."""
    world = dist.get_world_size()
    mesh = make_mesh((2, world // 2), ("dp", "tp"))
    seed = 100 + mesh.get_local_rank(0)
    case = {"seed": seed, "bias": True, "reduction": "mean", "smoothing": 0.1}
    for gif in (True, False):
        rows = _vocab_parallel_case(mesh, 1, 17, grad_in_forward=gif, compiled=gif, **case)
    return rows


def _fsdp_case(shard_head_only: bool, grad_in_forward: bool):
    """World-2 DP: each rank's loss equals the unsharded one on its tokens; the sharded weight
    gradient equals the average of the unsharded per-rank gradients (FSDP2 averages)."""
    torch.manual_seed(0)
    head = nn.Linear(8, 19, bias=True)
    ref_head = copy.deepcopy(head)
    loss_mod = LinearCrossEntropy(head, chunk_size=4, grad_in_forward=grad_in_forward)
    mesh = make_mesh((dist.get_world_size(),), ("dp",))
    if shard_head_only:
        fully_shard(loss_mod.lm_head, mesh=mesh)
    else:
        fully_shard(loss_mod, mesh=mesh)
    assert hasattr(loss_mod.lm_head.weight, "full_tensor")  # sharded outside forward
    for step in range(2):
        per_rank = [make_inputs(10, 8, 19, seed=50 + 10 * step + r)[::3] for r in range(2)]
        hidden, labels = per_rank[dist.get_rank()]
        h = hidden.clone().requires_grad_()
        loss_mod.zero_grad()
        loss = loss_mod(h, labels)
        loss.backward()
        refs = [reference(hd, ref_head.weight, lb, bias=ref_head.bias) for hd, lb in per_rank]
        ref_loss, ref_grads = refs[dist.get_rank()]
        assert_close(loss, ref_loss, name=f"loss step {step}", **TOL)
        assert_close(h.grad, ref_grads[0], name=f"grad_hidden step {step}", **TOL)
        mean_w = (refs[0][1][1] + refs[1][1][1]) / 2
        mean_b = (refs[0][1][2] + refs[1][1][2]) / 2
        assert_close(full(loss_mod.lm_head.weight.grad), mean_w, name="grad_weight", **TOL)
        assert_close(full(loss_mod.lm_head.bias.grad), mean_b, name="grad_bias", **TOL)


def check_fsdp_loss_module_unit():
    _fsdp_case(shard_head_only=False, grad_in_forward=True)


def check_fsdp_lm_head_own_unit():
    _fsdp_case(shard_head_only=True, grad_in_forward=True)


def check_fsdp_lm_head_own_unit_recompute():
    _fsdp_case(shard_head_only=True, grad_in_forward=False)


def check_num_valid_tokens_dp_microbatches():
    """2 DP ranks × 2 micro-batches of different sizes and ignore rates, mean loss divided by
    the global count, grads summed over micro-batches and ranks == one big batch's gradient
    (micro-batches alternate between the gradient-in-forward and the recompute path)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    weight = make_inputs(1, 6, 15, seed=0)[1]
    batches = [
        make_inputs(n, 6, 15, seed=200 + i, ignore_frac=f, bias=False)
        for i, (n, f) in enumerate([(9, 0.2), (4, 0.8), (12, 0.5), (3, 0.0)])
    ]
    mine = batches[2 * rank : 2 * rank + 2]
    total = global_num_valid_tokens(
        [lb for _, _, _, lb in mine], group=make_mesh((world,), ("dp",))
    )
    assert total == sum(int((lb != -100).sum()) for _, _, _, lb in batches)
    w = weight.clone().requires_grad_()
    grad_local_mean = torch.zeros_like(weight)
    for i, (hidden, _, _, labels) in enumerate(mine):
        linear_cross_entropy(
            hidden, w, labels, num_valid_tokens=total, chunk_size=4, grad_in_forward=i == 0
        ).backward()
        wl = weight.clone().requires_grad_()
        linear_cross_entropy(hidden, wl, labels).backward()
        grad_local_mean += wl.grad
    dist.all_reduce(w.grad)
    dist.all_reduce(grad_local_mean)
    all_hidden = torch.cat([h for h, _, _, _ in batches])
    all_labels = torch.cat([lb for _, _, _, lb in batches])
    _, ref_grads = reference(all_hidden, weight, all_labels)
    assert_close(w.grad, ref_grads[1], name="grad_weight", **TOL)
    # Per-micro-batch means do not give the big-batch gradient: the check can fail.
    assert not torch.allclose(
        grad_local_mean.double() / (2 * world), ref_grads[1], rtol=1e-3, atol=1e-4
    )


WORLD2 = [
    check_vocab_parallel_parity,
    check_vocab_parallel_three_matmuls,
    check_vocab_parallel_all_ignored,
    check_vocab_parallel_errors_are_agreed,
    check_fsdp_loss_module_unit,
    check_fsdp_lm_head_own_unit,
    check_fsdp_lm_head_own_unit_recompute,
    check_num_valid_tokens_dp_microbatches,
]
WORLD4 = [
    check_vocab_parallel_parity,
    check_vocab_parallel_all_ignored,
    check_vocab_parallel_errors_are_agreed,
    check_vocab_parallel_2d_mesh,
]


@pytest.fixture(scope="module")
def report2():
    return run_checks(WORLD2, 2, timeout=180)


@pytest.fixture(scope="module")
def report4():
    return run_checks(WORLD4, 4, timeout=180)


@pytest.mark.parametrize("check", WORLD2, ids=lambda c: c.__name__)
def test_world2(report2, check):
    report2.assert_passed(check)


@pytest.mark.parametrize("check", WORLD4, ids=lambda c: c.__name__)
def test_world4(report4, check):
    report4.assert_passed(check)


def test_uneven_split_shapes(report2, report4):
    """The parity cases above really ran on uneven shards, including an empty one."""
    # V = 29, 29, 9, 3, 32 → ceil(V/tp) rows per rank, the last rank gets the rest
    assert report2.assert_passed(check_vocab_parallel_parity) == [
        [15, 15, 5, 2, 16],
        [14, 14, 4, 1, 16],
    ]
    assert report4.assert_passed(check_vocab_parallel_parity) == [
        [8, 8, 3, 1, 8],
        [8, 8, 3, 1, 8],
        [8, 8, 3, 1, 8],
        [5, 5, 0, 0, 8],
    ]
