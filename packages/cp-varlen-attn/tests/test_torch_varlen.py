"""The ``torch_varlen`` backend: the marshalling of a rank's pieces into ONE call of torch's
``varlen_attn`` (``cu_seqlens`` of queries and of document-prefix keys, the max lengths, the
causal window, GQA) equals per-document attention, on one rank and on a CP group of 4.

On CPU the kernel is :func:`reference_varlen_attn`, written here from ``varlen_attn``'s
documentation (same signature; each ``cu_seq`` segment attends only to its own keys; the causal
window ``(-1, 0)`` aligned bottom-right, as torch's Flash kernels align it when a sequence has
more keys than queries; GQA only with ``enable_gqa``; the log-sum-exp returned on request). It
refuses what the real kernel cannot take (totals that do not match the tensors, a segment
longer than ``max_q`` / ``max_k``, unequal heads without ``enable_gqa``), so a marshalling slip
is an error or a wrong number, never a silent pass. On CUDA (``@pytest.mark.gpu``) the real
kernel is compared with the SDPA path in bf16 and with the fp32 SDPA path, forward and backward.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from reference import cu_from_lengths, per_document_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

import cp_varlen_attn.attention as attention
import cp_varlen_attn.torch_varlen as torch_varlen
from cp_varlen_attn import (
    STRATEGIES,
    plan_cp_layout,
    resolve_attention_backend,
    shard_sequence,
    varlen_attention,
)
from dist_testkit import assert_close, named_check, run_checks

# (name, document lengths, query heads, kv heads, head dim, causal)
CASES = [
    ("one_token_docs", [1, 7, 1, 1, 12, 1, 3], 4, 2, 8, True),
    ("doc_spans_all_ranks", [2, 61, 3], 2, 2, 16, True),
    ("gqa_head_dim_256", [13, 21], 4, 2, 256, True),
    ("bidirectional_gqa", [5, 17, 2, 9], 4, 1, 8, False),
]
TOL = {"rtol": 1e-9, "atol": 1e-10}


def reference_varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """``torch.nn.attention.varlen.varlen_attn`` in plain torch: query [T_q, H_q, D], key/value
    [T_k, H_kv, D(_v)], ``cu_seq_q`` / ``cu_seq_k`` [N + 1] int32; returns [T_q, H_q, D_v] (and
    the log-sum-exp [H_q, T_q] when ``return_aux.lse``)."""
    assert seqused_k is None and block_table is None, "training calls pass no KV cache"
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32, (cu_seq_q.dtype, cu_seq_k.dtype)
    cq, ck = cu_seq_q.tolist(), cu_seq_k.tolist()
    assert len(cq) == len(ck) and cq[0] == ck[0] == 0, (cq, ck)
    assert cq[-1] == query.shape[0] and ck[-1] == key.shape[0] == value.shape[0], (cq, ck)
    h_q, h_kv = query.shape[1], key.shape[1]
    if h_q != h_kv and not enable_gqa:
        raise ValueError(f"Hq={h_q} and Hkv={h_kv} differ: set enable_gqa=True for GQA")
    assert tuple(window_size) in ((-1, -1), (-1, 0)), window_size
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    outs, lses = [], []
    for i in range(len(cq) - 1):
        n_q, n_k = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        assert 0 <= n_q <= max_q and 0 <= n_k <= max_k, (i, n_q, max_q, n_k, max_k)
        q_HQD = query[cq[i] : cq[i + 1]].transpose(0, 1)
        k_HKD = key[ck[i] : ck[i + 1]].transpose(0, 1).repeat_interleave(h_q // h_kv, 0)
        v_HKD = value[ck[i] : ck[i + 1]].transpose(0, 1).repeat_interleave(h_q // h_kv, 0)
        scores_HQK = q_HQD @ k_HKD.transpose(1, 2) * scale
        if tuple(window_size) == (-1, 0):  # bottom-right: query j sees keys <= j + n_k - n_q
            seen_QK = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
            scores_HQK = scores_HQK.masked_fill(~seen_QK, float("-inf"))
        lse_HQ = torch.logsumexp(scores_HQK, dim=-1)
        outs.append(((scores_HQK - lse_HQ[..., None]).exp() @ v_HKD).transpose(0, 1))
        lses.append(lse_HQ)
    out = torch.cat(outs, 0)
    if return_aux is not None and return_aux.lse:
        return out, torch.cat(lses, 1)
    return out


def _use_reference(patch) -> None:
    """Run ``backend='auto'`` as ``torch_varlen`` with the reference kernel (``patch``:
    ``setattr``-like), so CPU tensors of any dtype go through the backend's marshalling."""
    patch(attention, "resolve_attention_backend", lambda *_: "torch_varlen")
    patch(torch_varlen, "_varlen_attn", lambda: reference_varlen_attn)


def _inputs(lengths, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return [
        torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)
    ]  # q, k, v and a random cotangent w


def _reference(lengths, hq, hkv, d, causal):
    q, k, v, w = _inputs(lengths, hq, hkv, d)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = per_document_attention(q, k, v, cu_from_lengths(lengths), causal=causal)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _sharded(lengths, hq, hkv, d, causal, strategy, group):
    cp = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    layout = plan_cp_layout(cu_from_lengths(lengths), cp, strategy=strategy)
    q, k, v, w = (shard_sequence(x, layout, rank, dim=0) for x in _inputs(lengths, hq, hkv, d))
    q, k, v = (x.clone().unsqueeze(0).requires_grad_() for x in (q, k, v))
    out = varlen_attention(q, k, v, layout, group, causal=causal)
    (out[0] * w).sum().backward()
    return layout, rank, out[0].detach(), q.grad[0], k.grad[0], v.grad[0]


def _compare(case, strategy):
    name, lengths, hq, hkv, d, causal = case
    ref = _reference(lengths, hq, hkv, d, causal)
    saved = (attention.resolve_attention_backend, torch_varlen._varlen_attn)
    _use_reference(setattr)
    try:
        layout, rank, *got = _sharded(lengths, hq, hkv, d, causal, strategy, dist.group.WORLD)
    finally:
        attention.resolve_attention_backend, torch_varlen._varlen_attn = saved
    for label, g, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert_close(
            g, shard_sequence(r, layout, rank, dim=0), name=f"{name}/{strategy}/{label}", **TOL
        )


CHECKS = [named_check(f"check_{c[0]}_{s}", _compare, c, s) for c in CASES for s in STRATEGIES]


@pytest.fixture(scope="module")
def report():
    return run_checks(CHECKS, 4, timeout=180)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_cp4_equals_per_document_attention(report, check):
    report.assert_passed(check)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_cp1_equals_per_document_attention(monkeypatch, case):
    name, lengths, hq, hkv, d, causal = case
    _use_reference(monkeypatch.setattr)
    ref = _reference(lengths, hq, hkv, d, causal)
    _, _, *got = _sharded(lengths, hq, hkv, d, causal, "balanced", None)
    for label, g, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        assert_close(g, r, name=f"{name}/{label}", **TOL)


def test_the_pieces_become_cu_seqlens_of_queries_and_document_prefix_keys():
    """CP 2, zigzag: rank 0 holds [0, 2) and [6, 8) of each of two documents of 8 tokens; each
    piece's keys are its document's prefix: [0, 2), [0, 8), [8, 10), [8, 16) of the sequence."""
    layout = plan_cp_layout([0, 8, 16], 2, strategy="zigzag")
    assert [(p.doc, p.start, p.end) for p in layout.pieces[0]] == [
        (0, 0, 2),
        (0, 6, 8),
        (1, 0, 2),
        (1, 6, 8),
    ]
    pieces = attention._piece_keys(layout, 0, torch.arange(16), causal=True)
    key_rows, cu_q, cu_k, max_q, max_k = torch_varlen.varlen_args(pieces, torch.device("cpu"))
    assert key_rows.tolist() == [0, 1, *range(8), 8, 9, *range(8, 16)]
    assert (cu_q.tolist(), cu_k.tolist(), max_q, max_k) == (
        [0, 2, 4, 6, 8],
        [0, 2, 10, 12, 20],
        2,
        8,
    )
    assert cu_q.dtype == cu_k.dtype == torch.int32
    # whole documents (one rank): one tensor for both, so torch may take cuDNN for causal
    layout = plan_cp_layout([0, 5, 12], 1)
    pieces = attention._piece_keys(layout, 0, torch.arange(12), causal=True)
    _, cu_q, cu_k, max_q, max_k = torch_varlen.varlen_args(pieces, torch.device("cpu"))
    assert cu_k is cu_q and cu_q.tolist() == [0, 5, 12] and (max_q, max_k) == (7, 7)


def test_auto_takes_torch_varlen_on_cuda_in_half_precision_when_flash_attn_is_absent(
    monkeypatch,
):
    monkeypatch.setattr(attention, "_flash_available", lambda: False)
    assert resolve_attention_backend("auto", "cuda", torch.bfloat16) == "torch_varlen"
    assert resolve_attention_backend("auto", "cuda", torch.float16) == "torch_varlen"
    assert resolve_attention_backend("auto", "cuda") == "torch_varlen"
    # fp32 on CUDA: no varlen kernel takes it, the per-piece SDPA path runs
    assert resolve_attention_backend("auto", "cuda", torch.float32) == "torch"
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "torch"
    monkeypatch.setattr(attention, "_flash_available", lambda: True)
    assert resolve_attention_backend("auto", "cuda", torch.bfloat16) == "flash"
    assert resolve_attention_backend("torch_varlen", "cuda", torch.bfloat16) == "torch_varlen"


def test_a_named_varlen_backend_that_cannot_run_is_one_clear_error():
    with pytest.raises(ValueError, match=r"'torch_varlen' needs CUDA tensors .*got cpu tensors"):
        resolve_attention_backend("torch_varlen", "cpu")
    with pytest.raises(ValueError, match=r"takes bfloat16 or float16 tensors, got torch.float32"):
        resolve_attention_backend("torch_varlen", "cuda", torch.float32)
    layout = plan_cp_layout([0, 4, 9], 1)
    x = torch.randn(1, 9, 2, 8)
    with pytest.raises(ValueError, match=r"'torch_varlen' needs CUDA tensors"):
        varlen_attention(x, x, x, layout, backend="torch_varlen")


def _pieces_of(lengths, cp, rank, causal):
    """(the CP layout, one rank's pieces) with the keys read from the whole sequence (row_of =
    position): the backend's inputs without a process group."""
    layout = plan_cp_layout(cu_from_lengths(lengths), cp, strategy="zigzag")
    return layout, attention._piece_keys(layout, rank, torch.arange(layout.seq_len), causal)


def _run(kernel, q, k, v, w, pieces, causal):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = kernel(q, k, v, pieces, 1.0 / math.sqrt(q.shape[-1]), causal)
    (out.float() * w).sum().backward()
    return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("hq, hkv, d", [(4, 2, 64), (8, 8, 128), (4, 1, 256)])
@pytest.mark.parametrize("rank", [0, 1, 3])
def test_the_real_kernel_matches_the_sdpa_path_in_bf16_and_fp32(causal, hq, hkv, d, rank):
    """The pieces of rank ``rank`` of a CP 4 zigzag layout (pieces that start mid-document, so
    the bottom-right causal alignment is exercised) through torch's varlen_attn in bf16,
    forward and backward, against the SDPA path in fp32 on the same (upcast) inputs: its error
    is at most twice the bf16 SDPA path's own plus bf16 rounding."""
    torch.manual_seed(0)
    lengths = [37, 5, 300, 1, 129]
    layout, pieces = _pieces_of(lengths, 4, rank, causal)
    pieces = [(a, n, s, rows.cuda()) for a, n, s, rows in pieces]
    q, k, v, _ = (x.cuda() for x in _inputs(lengths, hq, hkv, d))
    q = shard_sequence(q, layout, rank, dim=0)
    w = torch.randn(q.shape[0], hq, d, device="cuda")
    half = [x.to(torch.bfloat16) for x in (q, k, v)]
    got = _run(torch_varlen.torch_varlen_pieces, *half, w, pieces, causal)
    with sdpa_kernel(SDPBackend.MATH):  # plain bf16 attention, as flash-attn's own tests take
        sdpa_bf16 = _run(attention._torch_pieces, *half, w, pieces, causal)
    sdpa_fp32 = _run(attention._torch_pieces, *(x.float() for x in half), w, pieces, causal)
    for label, g, b, f in zip(("out", "dq", "dk", "dv"), got, sdpa_bf16, sdpa_fp32, strict=True):
        # the kernel's bf16 error (against fp32) within twice the bf16 SDPA path's own error,
        # plus bf16's rounding of the result (a misaligned mask is off by the values' scale)
        kernel_err, sdpa_err = (g - f).abs().max().item(), (b - f).abs().max().item()
        rounding = 1e-2 * f.abs().max().item()
        assert kernel_err <= 2 * sdpa_err + rounding, (label, kernel_err, sdpa_err, rounding)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_runs_torch_varlen_in_bf16_and_the_sdpa_path_in_fp32(monkeypatch):
    """Without flash-attn, ``auto`` on CUDA: bf16 runs varlen_attn (counted), fp32 the SDPA
    path, each equal to per-document attention; an explicit fp32 torch_varlen is refused."""
    monkeypatch.setattr(attention, "_flash_available", lambda: False)
    calls = []
    real = torch_varlen._varlen_attn()

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_varlen, "_varlen_attn", lambda: counted)
    lengths = [37, 5, 120, 1]
    layout = plan_cp_layout(cu_from_lengths(lengths), 1)
    q, k, v, _ = (x.cuda() for x in _inputs(lengths, 4, 2, 64))
    ref = per_document_attention(q, k, v, cu_from_lengths(lengths))
    bf16 = varlen_attention(*(x[None].to(torch.bfloat16) for x in (q, k, v)), layout)
    torch.testing.assert_close(bf16[0].double(), ref, rtol=2e-2, atol=2e-2)
    assert calls == [torch.bfloat16]
    fp32 = varlen_attention(*(x[None].float() for x in (q, k, v)), layout)
    torch.testing.assert_close(fp32[0].double(), ref, rtol=1e-5, atol=1e-5)
    assert calls == [torch.bfloat16]  # fp32 did not reach varlen_attn
    with pytest.raises(ValueError, match="takes bfloat16 or float16"):
        varlen_attention(*(x[None].float() for x in (q, k, v)), layout, backend="torch_varlen")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fa3_is_activated_exactly_where_it_can_run():
    import importlib.util

    from torch.nn.attention import current_flash_attention_impl, list_flash_attention_impls

    impl = torch_varlen.activate_fa3(torch.device("cuda"))
    can = (
        torch.cuda.get_device_capability()[0] == 9
        and "FA3" in list_flash_attention_impls()
        and importlib.util.find_spec("flash_attn_interface") is not None
    )
    assert impl == ("FA3" if can else "FA2")
    assert (current_flash_attention_impl() or "FA2") == impl
