"""Under CP (gloo, 2, 4 and — for the gated delta rule's prefix scan — 8 ranks, every layout
strategy plus a hand-made layout whose pieces sit out of rank order and back to back on one
rank): gated_delta_rule equals the single-rank packed
result forward and backward (q, k, v, g, beta, initial_state, final state); causal_conv1d equals
F.conv1d per document; a tiny transformers Qwen3_5MoeGatedDeltaNet run per document equals the
CP-sharded run through packed_gated_deltanet_forward."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from gdn_reference import conv_per_document, cu_from_lengths

from cp_varlen_attn import (
    STRATEGIES,
    CPLayout,
    Piece,
    causal_conv1d,
    gated_delta_rule,
    packed_gated_deltanet_forward,
    plan_cp_layout,
    shard_sequence,
)
from dist_testkit import assert_close, named_check, run_checks

LENGTHS = [1, 150, 3, 70, 1, 40]
LAYOUTS = (*STRATEGIES, "shuffled")


def _shuffled_layout(lengths, cp):
    """Each document cut in five pieces owned by ranks cp-1, 0, 0, cp-1, 1 (mod cp)."""
    cu = cu_from_lengths(lengths)
    owners = [(cp - 1) % cp, 0, 0, (cp - 1) % cp, 1 % cp]
    pieces = [[] for _ in range(cp)]
    for d, n in enumerate(lengths):
        cuts = sorted({n * j // 5 for j in range(6)})
        for j, (s, e) in enumerate(itertools.pairwise(cuts)):
            pieces[owners[j]].append(Piece(d, s, e))
    ordered = tuple(tuple(sorted(p, key=lambda x: cu[x.doc] + x.start)) for p in pieces)
    return CPLayout(tuple(cu), ordered, "shuffled")


def _layout(name, lengths, cp):
    if name == "shuffled":
        return _shuffled_layout(lengths, cp)
    return plan_cp_layout(cu_from_lengths(lengths), cp, strategy=name, token_weight=4.0)


def _gdn_inputs(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, n = sum(lengths), len(lengths)
    q, k = (torch.randn(1, t, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, t, 2, 4, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, t, 2, generator=gen, dtype=torch.float64) * 0.3
    beta = torch.rand(1, t, 2, generator=gen, dtype=torch.float64)
    s0 = torch.randn(n, 2, 8, 4, generator=gen, dtype=torch.float64)
    w = torch.randn(1, t, 2, 4, generator=gen, dtype=torch.float64)
    wf = torch.randn(n, 2, 8, 4, generator=gen, dtype=torch.float64)
    return (q, k, v, g, beta, s0), w, wf


def check_gdn(layout_name):
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = _layout(layout_name, LENGTHS, world)
    (q, k, v, g, beta, s0), w, wf = _gdn_inputs(LENGTHS)
    full = [x.clone().requires_grad_() for x in (q, k, v, g, beta, s0)]
    out, final = gated_delta_rule(
        *full[:5], cu_seqlens=layout.cu_seqlens, initial_state=full[5], output_final_state=True
    )
    ref_grads = torch.autograd.grad((out * w).sum() + (final * wf).sum(), full)

    local = [shard_sequence(x, layout, rank).requires_grad_() for x in (q, k, v, g, beta)]
    s0_local = s0.clone().requires_grad_()
    out_l, final_l = gated_delta_rule(
        *local,
        initial_state=s0_local,
        output_final_state=True,
        layout=layout,
        group=dist.group.WORLD,
    )
    loss = (out_l * shard_sequence(w, layout, rank)).sum() + (final_l * wf).sum()
    grads = torch.autograd.grad(loss, [*local, s0_local])
    assert_close(out_l, shard_sequence(out, layout, rank), rtol=1e-9, atol=1e-10, name="out")
    final_sum = final_l.detach().clone()
    dist.all_reduce(final_sum)
    assert_close(
        final_sum, final.detach(), rtol=1e-9, atol=1e-10, name="final_state (sum over ranks)"
    )
    for name, got, want in zip(("q", "k", "v", "g", "beta"), grads[:5], ref_grads[:5], strict=True):
        assert_close(
            got, shard_sequence(want, layout, rank), rtol=1e-8, atol=1e-9, name=f"grad {name}"
        )
    s0_grad = grads[5].clone()
    dist.all_reduce(s0_grad)
    assert_close(
        s0_grad, ref_grads[5], rtol=1e-8, atol=1e-9, name="grad initial_state (sum over ranks)"
    )


def check_conv(layout_name):
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = _layout(layout_name, LENGTHS, world)
    gen = torch.Generator().manual_seed(5)
    t, c, kernel = sum(LENGTHS), 6, 4
    x = torch.randn(1, t, c, generator=gen, dtype=torch.float64)
    weight = torch.randn(c, kernel, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(c, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, t, c, generator=gen, dtype=torch.float64)
    x_full = x.clone().requires_grad_()
    ref = conv_per_document(x_full[0], weight, bias, layout.cu_seqlens).unsqueeze(0)
    ref_grads = torch.autograd.grad((ref * w).sum(), [x_full, weight, bias])
    x_local = shard_sequence(x, layout, rank).requires_grad_()
    out = causal_conv1d(x_local, weight, bias, layout=layout, group=dist.group.WORLD)
    grads = list(
        torch.autograd.grad((out * shard_sequence(w, layout, rank)).sum(), [x_local, weight, bias])
    )
    assert_close(out, shard_sequence(ref, layout, rank), rtol=1e-10, atol=1e-12, name="conv out")
    assert_close(
        grads[0], shard_sequence(ref_grads[0], layout, rank), rtol=1e-10, atol=1e-12, name="grad x"
    )
    for i, name in ((1, "weight"), (2, "bias")):
        grads[i] = grads[i].contiguous()  # assert_close views its input flat
        dist.all_reduce(grads[i])
        assert_close(
            grads[i], ref_grads[i], rtol=1e-10, atol=1e-12, name=f"grad {name} (sum over ranks)"
        )


def _tiny_layer():
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    config = Qwen3_5MoeTextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    layer = Qwen3_5MoeGatedDeltaNet(config, layer_idx=0).double()
    with torch.no_grad():
        layer.norm.weight.normal_(1.0, 0.1)
    return layer


def check_hf_layer(layout_name):
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = _layout(layout_name, LENGTHS, world)
    layer = _tiny_layer()
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, sum(LENGTHS), 32, generator=gen, dtype=torch.float64)
    cu = layout.cu_seqlens
    ref = torch.cat([layer(hidden[:, s:e]) for s, e in itertools.pairwise(cu)], dim=1)
    ref_grads = torch.autograd.grad(ref.square().sum(), list(layer.parameters()))
    local = shard_sequence(hidden, layout, rank)
    out = packed_gated_deltanet_forward(layer, local, layout=layout, group=dist.group.WORLD)
    # transformers runs the recurrence in fp32 whatever the layer dtype; this path in fp64
    assert_close(out, shard_sequence(ref, layout, rank), rtol=1e-5, atol=1e-5, name="layer out")
    grads = torch.autograd.grad(out.square().sum(), list(layer.parameters()))
    for (name, _), got, want in zip(layer.named_parameters(), grads, ref_grads, strict=True):
        got = got.clone()
        dist.all_reduce(got)
        assert_close(got, want, rtol=1e-4, atol=1e-4, name=f"grad {name} (sum over ranks)")


def check_wrong_local_length_raises_on_every_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = _layout("balanced", LENGTHS, world)
    (q, k, v, g, beta, _), _, _ = _gdn_inputs(LENGTHS)
    local = [shard_sequence(x, layout, rank) for x in (q, k, v, g, beta)]
    if rank == 0:
        local = [x[:, 1:] for x in local]
    with pytest.raises(ValueError, match="tokens in the layout" if rank == 0 else "rank"):
        gated_delta_rule(*local, layout=layout, group=dist.group.WORLD)
    x = shard_sequence(torch.randn(1, sum(LENGTHS), 3), layout, rank)
    with pytest.raises(ValueError, match="tokens in the layout" if rank == 0 else "rank"):
        causal_conv1d(
            x[:, 1:] if rank == 0 else x, torch.randn(3, 4), layout=layout, group=dist.group.WORLD
        )


def check_different_layouts_raise_on_every_rank():
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = _layout("contiguous" if rank == 0 else "balanced", LENGTHS, world)
    (q, k, v, g, beta, _), _, _ = _gdn_inputs(LENGTHS)
    local = [shard_sequence(x, layout, rank) for x in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="different layouts"):
        gated_delta_rule(*local, layout=layout, group=dist.group.WORLD)


CORE = [
    named_check(f"check_{kind.__name__[6:]}_{name}", kind, name)
    for kind in (check_gdn, check_conv)
    for name in LAYOUTS
]
CORE += [check_wrong_local_length_raises_on_every_rank, check_different_layouts_raise_on_every_rank]
# The transformers layer (and its import) only at CP=2: the CP machinery under it is the same.
HF = [
    named_check(f"check_hf_layer_{name}", check_hf_layer, name) for name in ("balanced", "shuffled")
]
# CP=8: the prefix scan over up to 15 runs of one document (4 rounds), GDN only.
PREFIX = [c for c in CORE if c.__name__.startswith("check_gdn_")]
CHECKS = {2: CORE + HF, 4: CORE, 8: PREFIX}


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda w: f"cp{w}")
def report(request):
    return run_checks(CHECKS[request.param], request.param, timeout=180)


@pytest.mark.parametrize("check", CORE + HF, ids=lambda c: c.__name__)
def test_cp(report, check):
    if check not in CHECKS[report.world_size]:
        pytest.skip(f"not part of the CP={report.world_size} launch")
    report.assert_passed(check)
