"""Checks run on every rank of a gloo launch (see test_dist.py). Each compares with the
single-process MoE run over the same global tokens, forward and backward, in fp32."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from helpers import IDLE_EXPERT, lora_moe, tiny_moe, tokens
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from toy_vlm import VLM

from dist_testkit import assert_close, full, make_mesh
from moe_parallel import (
    apply_activation_checkpointing,
    apply_expert_parallel,
    apply_tensor_parallel,
)
from moe_parallel.lora import ADAPTERS as LORA_ADAPTERS

REPLICATED = (
    "gate.weight",
    "shared_expert_gate.weight",
    "shared_expert.gate_proj.weight",
    "shared_expert.up_proj.weight",
    "shared_expert.down_proj.weight",
)
EXPERT = ("experts.gate_up_proj", "experts.down_proj")
ADAPTERS = tuple(f"experts.{n}" for n in LORA_ADAPTERS)
SHARED_PLAN = {
    "shared_expert.gate_proj": ColwiseParallel(),
    "shared_expert.up_proj": ColwiseParallel(),
    "shared_expert.down_proj": RowwiseParallel(),
}


def seq_len(rank: int) -> int:
    """Tokens on ``rank``: 3, 0, 7, 9, ... (rank 1 has none: it still joins every exchange)."""
    return 0 if rank == 1 else 3 + 2 * rank


def _rank_inputs(world: int, seed: int):
    """Uneven sequence lengths per rank (see ``seq_len``) and matching output weights."""
    xs = [tokens(1, seq_len(r), seed + r) for r in range(world)]
    gs = [
        torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 50 + r))
        for r, x in enumerate(xs)
    ]
    return xs, gs


def _reference(xs, gs, moe=None):
    ref = moe or tiny_moe()
    ref.experts.backend = "torch"
    x = torch.cat(xs, dim=1).requires_grad_()
    y = ref(x)
    (y * torch.cat(gs, dim=1)).sum().backward()
    return ref, y.detach(), x.grad


def _grad(module, name):
    return module.get_parameter(name).grad


def _ep_run(world, detach_router=False, backend="torch", compiled=False):
    rank = dist.get_rank()
    xs, gs = _rank_inputs(world, seed=10)
    ref, y_ref, gx_ref = _reference(xs, gs)
    moe = tiny_moe()
    moe.experts.backend = backend
    moe = apply_expert_parallel(moe, make_mesh((world,), ("ep",)))
    if compiled:  # as a trainer compiles its decoder blocks
        moe.compile(dynamic=True)
    if detach_router:
        moe.gate.register_forward_hook(lambda m, i, out: (out[0], out[1].detach(), out[2]))
    x = xs[rank].clone().requires_grad_()
    y = moe(x)
    (y * gs[rank]).sum().backward()
    start = sum(t.shape[1] for t in xs[:rank])
    rows = slice(start, start + xs[rank].shape[1])
    return ref, moe, (y, y_ref[:, rows]), (x.grad, gx_ref[:, rows])


def _summed(moe, name):
    g = _grad(moe, name)
    g = torch.zeros_like(moe.get_parameter(name)) if g is None else g.clone()
    dist.all_reduce(g)
    return g


def check_ep_parity(backend: str = "torch", compiled: bool = False) -> list[int]:
    """EP = world: outputs, input grads, expert grads (gathered) and router / shared-expert grads
    (summed over ranks as data parallelism would) equal the reference; an idle expert's grad is
    zero, not None."""
    world = dist.get_world_size()
    ref, moe, (y, y_ref), (gx, gx_ref) = _ep_run(world, backend=backend, compiled=compiled)
    assert_close(y, y_ref, name="output")
    assert_close(gx, gx_ref, name="x.grad")
    for name in EXPERT:
        assert _grad(moe, name) is not None, name
        assert_close(full(_grad(moe, name)), _grad(ref, name), name=name)
    for name in REPLICATED:
        assert_close(_summed(moe, name), _grad(ref, name), name=name)
    assert ref.stats.tokens_per_expert[IDLE_EXPERT] == 0
    assert torch.count_nonzero(full(_grad(moe, "experts.down_proj"))[IDLE_EXPERT]) == 0
    local_rows = moe.experts.gate_up_proj.to_local().shape[0]
    assert local_rows == 8 // world
    return moe.stats.tokens_per_expert.tolist()


def check_compiled_ep_parity() -> list[int]:
    """``check_ep_parity`` with the MoE block ``torch.compile``-d: the routed experts run eagerly
    inside it (``Experts.forward`` is excluded from compilation), so each EP rank computes with
    its own expert shards, not the DTensor's global shape."""
    return check_ep_parity(compiled=True)


def check_ep_parity_te_stand_in() -> list[int]:
    """``check_ep_parity`` with the TE backend (CPU stand-in with TE's zero-row garbage): every
    rank's local expert views get their gradients through TE's autograd into the DTensor shard."""
    import fake_te

    from moe_parallel import te_backend

    fake_te.install()
    te_backend.TE_DEVICE_TYPES = ("cuda", "cpu")
    try:
        return check_ep_parity(backend="te")
    finally:
        te_backend.TE_DEVICE_TYPES = ("cuda",)


def check_global_aux_loss_share() -> None:
    """Under EP with ``aux_loss_group``: the per-rank shares sum to the single-process aux loss
    of the concatenated tokens, and the summed router grads of the shares equal its grad. The
    per-rank (local-batch) losses do not average to it (negative control)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    xs, _ = _rank_inputs(world, seed=110)
    ref = tiny_moe()
    ref(torch.cat(xs, dim=1))
    ref.stats.aux_loss.backward()
    mesh = make_mesh((world,), ("ep",))
    moe = apply_expert_parallel(tiny_moe(), mesh)
    moe(xs[rank])
    local = moe.stats.aux_loss.detach().clone()
    moe.aux_loss_group = mesh.get_group()
    moe(xs[rank])
    share = moe.stats.aux_loss
    share.backward()
    total = share.detach().clone()
    dist.all_reduce(total)
    assert_close(total, ref.stats.aux_loss.detach(), name="sum of shares")
    assert_close(_summed(moe, "gate.weight"), _grad(ref, "gate.weight"), name="gate.weight")
    dist.all_reduce(local)
    gap = (local / world - ref.stats.aux_loss.detach()).abs().item()
    assert gap > 1e-3, f"local aux losses average to the global one ({gap}): control too weak"


def check_ep_detached_router_is_caught() -> None:
    """Negative control: router weights detached before the combine → router grad differs."""
    world = dist.get_world_size()
    ref, moe, (y, y_ref), _ = _ep_run(world, detach_router=True)
    assert_close(y, y_ref, name="output")  # the forward cannot tell
    try:
        assert_close(_summed(moe, "gate.weight"), _grad(ref, "gate.weight"), name="gate.weight")
    except AssertionError:
        return
    raise AssertionError("a detached router went unnoticed by the router-grad comparison")


def check_ep_size_must_divide_experts() -> None:
    world = dist.get_world_size()
    mesh = make_mesh((world,), ("ep",))
    moe = tiny_moe()
    moe.experts.num_experts = 3 if world == 2 else 6
    try:
        apply_expert_parallel(moe, mesh)
    except ValueError as e:
        assert f"EP size {world} must divide num_experts" in str(e), e
        return
    raise AssertionError("EP size not dividing the experts was accepted")


def _tp_mesh():
    world = dist.get_world_size()
    return make_mesh((world // 2, 2), ("dp", "tp"))


def check_ep_tp_grads() -> None:
    """EP over the TP ranks (EP2 x TP2 inside each DP replica): every TP rank feeds the same
    tokens, the shared expert is TP-sharded. Without ``tp_mesh=`` (each TP rank dispatching
    all its identical tokens) the expert grads are 2x: the negative control of
    check_ep_tp_token_split_exact; every other grad equals the replica's reference."""
    mesh = _tp_mesh()
    dp = mesh["dp"].get_local_rank()
    xs, gs = _rank_inputs(mesh["dp"].size(), seed=30)
    ref, y_ref, gx_ref = _reference([xs[dp]], [gs[dp]])
    moe = tiny_moe()
    apply_tensor_parallel(moe, mesh["tp"], SHARED_PLAN)
    apply_expert_parallel(moe, mesh["tp"])
    x = xs[dp].clone().requires_grad_()
    y = moe(x)
    (y * gs[dp]).sum().backward()
    assert_close(y, y_ref, name="output")
    assert_close(x.grad, gx_ref, name="x.grad")
    for name in EXPERT:
        assert_close(full(_grad(moe, name)), 2 * _grad(ref, name), name=f"{name} (doubled)")
    for name in REPLICATED:
        assert_close(full(_grad(moe, name)), _grad(ref, name), name=name)


def check_ep_tp_token_split_exact() -> None:
    """Same layout as check_ep_tp_grads, but each TP rank dispatches only its 1/tp token block
    (apply_expert_parallel(..., tp_mesh=...)): all grads equal the reference with no scaling.
    Replica 0 has 3 tokens (blocks of 2 and 1), replica 1 none."""
    mesh = _tp_mesh()
    dp = mesh["dp"].get_local_rank()
    xs, gs = _rank_inputs(mesh["dp"].size(), seed=30)
    ref, y_ref, gx_ref = _reference([xs[dp]], [gs[dp]])
    moe = tiny_moe()
    apply_tensor_parallel(moe, mesh["tp"], SHARED_PLAN)
    apply_expert_parallel(moe, mesh["tp"], tp_mesh=mesh["tp"])
    x = xs[dp].clone().requires_grad_()
    y = moe(x)
    (y * gs[dp]).sum().backward()
    assert_close(y, y_ref, name="output")
    assert_close(x.grad, gx_ref, name="x.grad")
    for name in EXPERT + REPLICATED:
        assert_close(full(_grad(moe, name)), _grad(ref, name), name=name)
    if mesh.size() == 4:
        try:
            apply_expert_parallel(tiny_moe(), mesh["tp"], tp_mesh=mesh["dp"])
        except ValueError as e:
            assert "not in ep_mesh" in str(e), e
        else:
            raise AssertionError("a tp_mesh outside the EP group was accepted")


def _ep_lora_run(seed: int, fp8_block=None):
    """:func:`lora_moe` (experts in FP8 with ``fp8_block``) under EP = world against one
    process: output, input grads and every adapter's gradient (gathered) compared; returns
    ``(reference, sharded)``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    xs, gs = _rank_inputs(world, seed=seed)
    ref, y_ref, gx_ref = _reference(xs, gs, moe=lora_moe(fp8_block=fp8_block))
    moe = apply_expert_parallel(lora_moe(fp8_block=fp8_block), make_mesh((world,), ("ep",)))
    x = xs[rank].clone().requires_grad_()
    y = moe(x)
    (y * gs[rank]).sum().backward()
    start = sum(t.shape[1] for t in xs[:rank])
    rows = slice(start, start + xs[rank].shape[1])
    assert_close(y, y_ref[:, rows], name="output")
    assert_close(x.grad, gx_ref[:, rows], name="x.grad")
    for name in ADAPTERS:
        assert_close(full(_grad(moe, name)), _grad(ref, name), name=name)
    return ref, moe


def check_ep_lora_parity() -> None:
    """Expert adapters sharded with their experts (EP = world, uneven tokens, a rank with
    none): output, input grads and every adapter's gradient (gathered) equal the one-process
    run; the frozen expert weights get no gradient; the idle expert's adapters get zeros."""
    _, moe = _ep_lora_run(seed=90)
    assert moe.experts.lora_gate_up_A.to_local().shape[0] == 8 // dist.get_world_size()
    for name in ADAPTERS:
        assert torch.count_nonzero(full(_grad(moe, name))[IDLE_EXPERT]) == 0, name
    assert all(_grad(moe, name) is None for name in EXPERT)


def check_ep_fp8_lora_parity() -> None:
    """Frozen FP8 experts with adapters under EP = world (uneven tokens, a rank with none):
    the FP8 bytes and the scales are scattered with their experts (as bytes: gloo has no
    float8), and the output, input grads and every adapter's gradient equal the one-process
    FP8 block's."""
    ref, moe = _ep_lora_run(seed=95, fp8_block=(3, 5))
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"):
        local = moe.experts.get_parameter(name).to_local()
        want = ref.experts.get_parameter(name).chunk(world)[rank]
        if local.element_size() == 1:  # FP8: compared as bytes
            local, want = local.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(local, want), name


def check_zero_token_optimizer_step() -> None:
    """All tokens pick experts 0 and 1 (rank 0's), so every other rank's experts get no rows.
    Their grads are zeros (not None); one AdamW step with weight decay then moves every expert —
    also the idle ones — exactly like the single-process step, and every rank keeps the same
    optimizer state layout and step count."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    base = tiny_moe()
    with torch.no_grad():
        base.gate.weight[:, 0] = -3.0
        base.gate.weight[:2, 0] = 3.0
    moe = apply_expert_parallel(copy.deepcopy(base), make_mesh((world,), ("ep",)))
    xs, gs = _rank_inputs(world, seed=70)
    ref, _, _ = _reference(xs, gs, moe=base)
    assert ref.stats.tokens_per_expert[2:].sum() == 0
    y = moe(xs[rank])
    (y * gs[rank]).sum().backward()
    for name in EXPERT:
        local = _grad(moe, name).to_local()
        assert local is not None
        if rank > 0:
            assert torch.count_nonzero(local) == 0
    for p in moe.parameters():
        if not hasattr(p, "to_local"):
            dist.all_reduce(p.grad)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (moe, ref)]
    for opt in opts:
        opt.step()
    for (name, p), p_ref in zip(moe.named_parameters(), ref.parameters(), strict=True):
        assert_close(full(p.detach()), p_ref.detach(), name=f"{name} after step")
    steps = torch.tensor([float(s["step"]) for s in opts[0].state.values()])
    assert len(opts[0].state) == len(list(moe.parameters()))
    gathered = [torch.zeros_like(steps) for _ in range(world)]
    dist.all_gather(gathered, steps)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def check_tp_shared_expert() -> None:
    """TP over the shared expert only (identical tokens per TP rank): values and all grads."""
    mesh = _tp_mesh()
    xs, gs = _rank_inputs(1, seed=90)
    ref, y_ref, gx_ref = _reference(xs, gs)
    moe = apply_tensor_parallel(tiny_moe(), mesh["tp"], SHARED_PLAN)
    x = xs[0].clone().requires_grad_()
    y = moe(x)
    (y * gs[0]).sum().backward()
    assert_close(y, y_ref, name="output")
    assert_close(x.grad, gx_ref, name="x.grad")
    for name in EXPERT + REPLICATED:
        assert_close(full(_grad(moe, name)), _grad(ref, name), name=name)
    assert hasattr(moe.shared_expert.gate_proj.weight, "full_tensor")


def _ac_grads(model, x):
    torch.manual_seed(5)
    x = x.clone().requires_grad_()
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = {
        n.replace("._checkpoint_wrapped_module", ""): full(p.grad)
        for n, p in model.named_parameters()
    }
    return y.detach(), x.grad, grads


def check_ac_under_ep_wraps_vision() -> None:
    """With EP > 1, language-only AC also wraps the trainable vision tower (not a frozen one),
    and the checkpointed EP model's output and grads equal the non-checkpointed EP model's."""
    world = dist.get_world_size()
    mesh = make_mesh((world,), ("ep",))
    torch.manual_seed(0)
    plain = VLM()
    ckpt = copy.deepcopy(plain)
    frozen = copy.deepcopy(plain)
    frozen.visual.requires_grad_(False)
    for m in (plain, ckpt, frozen):
        apply_expert_parallel(m, mesh)
    assert apply_activation_checkpointing(ckpt, scope=("language",)) == [
        "visual.blocks.0",
        "visual.blocks.1",
        "language_model.layers.0",
        "language_model.layers.1",
    ]
    assert apply_activation_checkpointing(frozen, scope=("language",)) == [
        "language_model.layers.0",
        "language_model.layers.1",
    ]
    x = torch.randn(
        1, 2 + dist.get_rank(), 16, generator=torch.Generator().manual_seed(dist.get_rank())
    )
    y0, gx0, g0 = _ac_grads(plain, x)
    y1, gx1, g1 = _ac_grads(ckpt, x)
    assert_close(y1, y0, name="output")
    assert_close(gx1, gx0, name="x.grad")
    assert g0.keys() == g1.keys()
    for name in g0:
        assert_close(g1[name], g0[name], name=name)
