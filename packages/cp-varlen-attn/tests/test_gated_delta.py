"""gated_delta_rule on one rank: equal to a token-by-token fp64 recurrence per document (values
and gradients of q, k, v, g, beta, initial_state, final state), to transformers' own torch
recurrence on a single document, and bad input is refused with a message."""

from __future__ import annotations

import pytest
import torch
from gdn_reference import cu_from_lengths, naive_gated_delta

from cp_varlen_attn import gated_delta_rule, plan_cp_layout, plan_summaries

# (name, document lengths, key heads, value heads, K, V)
CASES = [
    ("many_docs_with_length_one", [1, 70, 1, 5, 1, 64, 2, 66], 2, 4, 8, 6),
    ("one_long_doc", [200], 1, 1, 16, 8),
    ("equal_heads", [63, 65, 1], 2, 2, 4, 4),
]


def _inputs(lengths, hk, hv, dk, dv, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, n = sum(lengths), len(lengths)
    q = torch.randn(1, t, hk, dk, generator=gen, dtype=dtype)
    k = torch.randn(1, t, hk, dk, generator=gen, dtype=dtype)
    v = torch.randn(1, t, hv, dv, generator=gen, dtype=dtype)
    g = -torch.rand(1, t, hv, generator=gen, dtype=dtype) * 0.5
    beta = torch.rand(1, t, hv, generator=gen, dtype=dtype)
    s0 = torch.randn(n, hv, dk, dv, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta, s0)]


def _grads(out, final, inputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)
    wf = torch.randn(final.shape, generator=gen, dtype=final.dtype).to(final.device)
    return torch.autograd.grad((out * w).sum() + (final * wf).sum(), inputs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_packed_equals_naive_recurrence_per_document(case):
    _, lengths, hk, hv, dk, dv = case
    inputs = _inputs(lengths, hk, hv, dk, dv)
    q, k, v, g, beta, s0 = inputs
    cu = cu_from_lengths(lengths)
    out, final = gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=torch.tensor(cu),
        initial_state=s0,
        output_final_state=True,
        backend="torch",
    )
    ref_out, ref_final = naive_gated_delta(q[0], k[0], v[0], g[0], beta[0], cu, s0)
    torch.testing.assert_close(out[0], ref_out, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(final, ref_final, rtol=1e-10, atol=1e-11)
    got = _grads(out[0], final, inputs)
    want = _grads(ref_out, ref_final, inputs)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want, strict=True):
        torch.testing.assert_close(
            a, b, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"grad {name}: {m}"
        )


def test_zero_initial_state_no_l2norm_custom_scale_fp32():
    lengths = [33, 1, 90]
    q, k, v, g, beta, _ = _inputs(lengths, 1, 2, 8, 4)
    k64 = (
        torch.nn.functional.normalize(k.detach(), dim=-1) * 0.9
    )  # keep the un-normalised recurrence stable
    cu = cu_from_lengths(lengths)
    args32 = [x.detach().float() for x in (q, k64, v, g, beta)]
    out, final = gated_delta_rule(
        *args32, cu_seqlens=cu, use_qk_l2norm=False, scale=0.3, output_final_state=True
    )
    assert out.dtype == torch.float32 and final.dtype == torch.float32
    ref_out, ref_final = naive_gated_delta(
        q[0].detach(),
        k64[0],
        v[0].detach(),
        g[0].detach(),
        beta[0].detach(),
        cu,
        scale=0.3,
        l2norm=False,
    )
    torch.testing.assert_close(out[0].double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final.double(), ref_final, rtol=1e-5, atol=1e-5)
    none_out, none_final = gated_delta_rule(*args32, cu_seqlens=cu, use_qk_l2norm=False, scale=0.3)
    assert none_final is None and torch.equal(none_out, out)


def test_single_document_equals_transformers_recurrence():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, s0 = _inputs([150], 2, 4, 8, 8, dtype=torch.float32, seed=3)
    out, final = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    ref_out, ref_final = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)
    got = _grads(out, final, [q, k, v, g, beta, s0])
    want = _grads(ref_out, ref_final, [q, k, v, g, beta, s0])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_summary_exchange_does_not_grow_with_sequence_length():
    # one document over 4 contiguous ranks: rank r needs the r summaries before its piece
    for seq in (1000, 100_000):
        plan = plan_summaries(plan_cp_layout([0, seq], 4, strategy="contiguous"))
        assert [plan.received(r) for r in range(4)] == [0, 1, 2, 3]
        assert plan.summary_bytes_per_rank(32, 128, 128)[3] == 3 * 32 * 128 * 256 * 4
    # whole documents on their own ranks exchange nothing
    assert plan_summaries(plan_cp_layout([0, 10, 20, 30, 40], 4, strategy="balanced")).total == 0


def test_bad_input_is_refused():
    q, k, v, g, beta, s0 = (x.detach() for x in _inputs([5, 7], 2, 4, 8, 6))
    cases = [
        ({"backend": "triton"}, "unknown backend"),
        ({"backend": "fla"}, "flash-linear-attention"),
        ({"cu_seqlens": [0, 5, 11]}, "end at T=12"),
        (
            {"cu_seqlens": [0, 5, 12], "initial_state": s0[:1]},
            r"initial_state must be \[N, H_v, K, V\]",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            gated_delta_rule(q, k, v, g, beta, **kwargs)
    with pytest.raises(ValueError, match="multiple of query/key heads"):
        gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match="g and beta"):
        gated_delta_rule(q, k, v, g[:, :, :2], beta)
    with pytest.raises(ValueError, match=r"\[1, T, H_k, K\]"):
        gated_delta_rule(q[0], k[0], v, g, beta)


@pytest.mark.gpu
def test_fla_backend_matches_torch_path():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla.ops.gated_delta_rule", reason="needs flash-linear-attention (fla)")
    lengths = [1, 300, 77, 64, 129]
    inputs = [x.detach().float().cuda().requires_grad_() for x in _inputs(lengths, 2, 4, 64, 64)]
    cu = torch.tensor(cu_from_lengths(lengths), device="cuda")
    results = {}
    for backend in ("torch", "fla"):
        out, final = gated_delta_rule(
            *inputs[:5],
            cu_seqlens=cu,
            initial_state=inputs[5],
            output_final_state=True,
            backend=backend,
        )
        results[backend] = (out, final, _grads(out, final, inputs))
    for a, b in zip(
        results["fla"][:2] + tuple(results["fla"][2]),
        results["torch"][:2] + tuple(results["torch"][2]),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
