"""varlen_attention equals per-document attention of the whole packed sequence — outputs and
q/k/v gradients — on one rank and on gloo CP groups of 2 and 4, for every layout strategy."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from reference import cu_from_lengths, per_document_attention
from torch.utils.checkpoint import checkpoint

from cp_varlen_attn import STRATEGIES, plan_cp_layout, shard_sequence, varlen_attention
from dist_testkit import assert_close, named_check, run_checks

# (name, document lengths, query heads, kv heads, head dim, causal)
CASES = [
    ("one_token_docs", [1, 7, 1, 1, 12, 1, 3], 4, 2, 8, True),
    ("doc_spans_all_ranks", [2, 61, 3], 2, 2, 16, True),
    ("padding_middle_and_end", [9, 4, 11, 6, 5], 4, 1, 8, True),  # runs 2 and 5 play padding
    ("gqa_head_dim_256", [13, 21], 4, 2, 256, True),
    ("bidirectional", [5, 17, 2, 9], 2, 1, 8, False),
]
TOL = {"rtol": 1e-9, "atol": 1e-10}


def _inputs(lengths, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(t, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(t, hkv, d, generator=g, dtype=torch.float64)
    w = torch.randn(t, hq, d, generator=g, dtype=torch.float64)  # a random cotangent
    return q, k, v, w


def _reference(lengths, hq, hkv, d, causal):
    q, k, v, w = _inputs(lengths, hq, hkv, d)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = per_document_attention(q, k, v, cu_from_lengths(lengths), causal=causal)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _sharded(lengths, hq, hkv, d, causal, strategy, group, use_checkpoint=False):
    cp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    layout = plan_cp_layout(cu_from_lengths(lengths), cp, strategy=strategy)
    q, k, v, w = (shard_sequence(x, layout, rank, dim=0) for x in _inputs(lengths, hq, hkv, d))
    q, k, v = (x.clone().unsqueeze(0).requires_grad_() for x in (q, k, v))

    def attend(q, k, v):
        return varlen_attention(q, k, v, layout, group, causal=causal)

    out = checkpoint(attend, q, k, v, use_reentrant=False) if use_checkpoint else attend(q, k, v)
    (out[0] * w).sum().backward()
    return layout, rank, out[0].detach(), q.grad[0], k.grad[0], v.grad[0]


def _compare(case, strategy, use_checkpoint=False):
    name, lengths, hq, hkv, d, causal = case
    ref = _reference(lengths, hq, hkv, d, causal)
    layout, rank, *got = _sharded(
        lengths, hq, hkv, d, causal, strategy, dist.group.WORLD, use_checkpoint
    )
    for label, g, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert_close(
            g, shard_sequence(r, layout, rank, dim=0), name=f"{name}/{strategy}/{label}", **TOL
        )


def check_under_activation_checkpointing():
    _compare(CASES[1], "balanced", use_checkpoint=True)


def check_wrong_local_length_raises_on_every_rank():
    layout = plan_cp_layout(cu_from_lengths([6, 10]), dist.get_world_size(), strategy="balanced")
    n = layout.local_len(dist.get_rank()) + (1 if dist.get_rank() == 0 else 0)
    x = torch.randn(1, n, 2, 4)
    with pytest.raises(ValueError) as info:
        varlen_attention(x, x, x, layout, dist.group.WORLD)
    if dist.get_rank() == 0:
        assert "rank 0 holds" in str(info.value)
    else:
        assert "invalid input on rank(s) [0]" in str(info.value)


def check_different_layouts_raise_on_every_rank():
    strategy = "contiguous" if dist.get_rank() == 0 else "zigzag"
    layout = plan_cp_layout(cu_from_lengths([6, 10]), dist.get_world_size(), strategy=strategy)
    x = torch.randn(1, layout.local_len(dist.get_rank()), 2, 4)
    with pytest.raises(ValueError, match="different layouts"):
        varlen_attention(x, x, x, layout, dist.group.WORLD)


CHECKS = [named_check(f"check_{c[0]}_{s}", _compare, c, s) for c in CASES for s in STRATEGIES] + [
    check_under_activation_checkpointing,
    check_wrong_local_length_raises_on_every_rank,
    check_different_layouts_raise_on_every_rank,
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"cp{w}")
def report(request):
    return run_checks(CHECKS, request.param, timeout=180)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_cp(report, check):
    report.assert_passed(check)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_cp1_packed_equals_per_document(case):
    name, lengths, hq, hkv, d, causal = case
    ref = _reference(lengths, hq, hkv, d, causal)
    _, _, *got = _sharded(lengths, hq, hkv, d, causal, "balanced", None)
    for label, g, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert_close(g, r, name=f"{name}/{label}", **TOL)


def test_single_rank_bad_input():
    layout = plan_cp_layout([0, 4, 9], 1)
    x = torch.randn(1, 9, 4, 8)
    with pytest.raises(ValueError, match="batch size must be 1"):
        varlen_attention(
            x.expand(2, -1, -1, -1), x.expand(2, -1, -1, -1), x.expand(2, -1, -1, -1), layout
        )
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        varlen_attention(x, x[:, :, :3], x[:, :, :3], layout)
    with pytest.raises(ValueError, match="holds 9 tokens in the layout but got 8"):
        varlen_attention(x[:, :8], x[:, :8], x[:, :8], layout)
    with pytest.raises(ValueError, match="unknown backend"):
        varlen_attention(x, x, x, layout, backend="xformers")
    with pytest.raises(ValueError, match="flash-attn package and CUDA"):
        varlen_attention(x, x, x, layout, backend="flash")
    with pytest.raises(ValueError, match="layout is for 2 CP ranks but the group has 1"):
        varlen_attention(x, x, x, plan_cp_layout([0, 4, 9], 2))


def test_long_piece_uses_query_blocks(monkeypatch):
    import cp_varlen_attn.attention as attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", 5)  # pieces of 23 tokens: several blocks each
    case = ("blocks", [23, 4], 2, 1, 8, True)
    ref = _reference(*case[1:])
    _, _, *got = _sharded(*case[1:], "balanced", None)
    for g, r in zip(got, ref, strict=True):
        assert_close(g, r, **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_backend_matches_torch():
    pytest.importorskip("flash_attn", reason="needs flash-attn (cp-varlen-attn[flash-attn])")
    lengths = [37, 5, 120, 1]
    layout = plan_cp_layout(cu_from_lengths(lengths), 1)
    q, k, v, _ = (x.to("cuda", torch.bfloat16) for x in _inputs(lengths, 4, 2, 64))
    a = varlen_attention(q[None], k[None], v[None], layout, backend="flash")
    b = varlen_attention(q[None], k[None], v[None], layout, backend="torch")
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
