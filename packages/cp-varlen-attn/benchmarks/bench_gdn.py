"""Gated delta rule: CPU time of the packed chunked path, and bytes exchanged under CP.

1. Time (CPU, fp32, one thread per torch default): ``gated_delta_rule`` on a packed sequence
   (one call, state reset at every document) vs transformers' pure-torch
   ``torch_chunk_gated_delta_rule`` called document by document (its fallback refuses
   ``cu_seqlens``, so per-document calls are the exact alternative), forward and
   forward + backward. Both outputs are compared, so the timing is of equal results.
2. Bytes each rank receives per GDN layer under CP for the 131,072-token packs of ``packs.py``
   (seed 0) at CP = 8 and 32 (max over ranks): the affine summaries of the prefix scan (fp32
   [H_v, K, K + V] each, ``rounds`` uneven all-to-alls) vs all-gathering the layer's per-token
   inputs (q, k, v, g, beta in bf16). Head sizes (REFERENCE.md): Qwen3.5-35B-A3B's GDN, 16 key
   heads / 32 value heads of 128; 122B-A10B's, 16 / 64 heads of 128.

    python benchmarks/bench_gdn.py
"""

from __future__ import annotations

import itertools
import random
import time

import torch
from packs import KINDS, cu_of, pack

from cp_varlen_attn import gated_delta_rule, plan_cp_layout, plan_summaries

HEADS = {"35B-A3B (16/32x128)": (16, 32, 128, 128), "122B-A10B (16/64x128)": (16, 64, 128, 128)}


def _timed(fn, repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def time_table() -> None:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule

    rng = random.Random(0)
    print("CPU time, fp32, H_k=2, H_v=4, K=V=64 (best of 3)")
    header = f"{'tokens':>7}{'docs':>6}  {'pass':<10}{'per-doc HF (ms)':>16}{'packed (ms)':>13}{'speed-up':>10}"
    print(header)
    print("-" * len(header))
    for total, median in ((4096, 60), (4096, 400), (16384, 400)):
        lengths: list[int] = []
        while sum(lengths) < total:
            lengths.append(
                max(1, int(rng.lognormvariate(torch.log(torch.tensor(median)).item(), 1.0)))
            )
        lengths[-1] -= sum(lengths) - total
        lengths = [n for n in lengths if n > 0]
        cu = cu_of(lengths)
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.randn(1, total, 2, 64, generator=gen) for _ in range(2))
        v = torch.randn(1, total, 4, 64, generator=gen)
        g = -torch.rand(1, total, 4, generator=gen)
        beta = torch.rand(1, total, 4, generator=gen)
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]

        def per_doc(backward: bool, leaves=leaves, cu=cu) -> torch.Tensor:
            q, k, v, g, beta = leaves
            outs = [
                torch_chunk_gated_delta_rule(
                    q[:, s:e],
                    k[:, s:e],
                    v[:, s:e],
                    g[:, s:e],
                    beta[:, s:e],
                    use_qk_l2norm_in_kernel=True,
                )[0]
                for s, e in itertools.pairwise(cu)
            ]
            out = torch.cat(outs, 1)
            if backward:
                out.sum().backward()
            return out

        def packed(backward: bool, leaves=leaves, cu=cu) -> torch.Tensor:
            out, _ = gated_delta_rule(*leaves, cu_seqlens=cu, backend="torch")
            if backward:
                out.sum().backward()
            return out

        with torch.no_grad():
            diff = (per_doc(False) - packed(False)).abs().max().item()
        assert diff < 1e-4, f"results differ by {diff}"
        for name, backward in (("forward", False), ("fwd+bwd", True)):
            ctx = torch.enable_grad() if backward else torch.no_grad()
            with ctx:
                t_ref = _timed(lambda backward=backward: per_doc(backward))
                t_ours = _timed(lambda backward=backward: packed(backward))
            print(
                f"{total:>7}{len(lengths):>6}  {name:<10}{t_ref * 1e3:>16.1f}{t_ours * 1e3:>13.1f}{t_ref / t_ours:>9.1f}x"
            )


def bytes_table() -> None:
    print("\nBytes received per rank per GDN layer, 131,072 tokens (max over ranks)")
    header = f"{'heads':<24}{'pack':<15}{'cp':>3}  {'strategy':<11}{'rounds':>7}{'recv':>6}{'summaries':>11}{'all-gather':>12}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for heads_name, (hk, hv, dk, dv) in HEADS.items():
        token_bytes = 2 * (2 * hk * dk + hv * dv + 2 * hv)  # q, k, v, g, beta in bf16
        for kind in KINDS:
            cu = cu_of(pack(kind, 0))
            for cp in (8, 32):
                for strategy in ("contiguous", "zigzag", "balanced"):
                    layout = plan_cp_layout(cu, cp, strategy=strategy)
                    plan = plan_summaries(layout)
                    summary = max(plan.summary_bytes_per_rank(hv, dk, dv))
                    gather = max(layout.all_gather_kv_bytes(token_bytes))
                    received = max(plan.received(r) for r in range(cp))
                    print(
                        f"{heads_name:<24}{kind:<15}{cp:>3}  {strategy:<11}{plan.collectives:>7}{received:>6}"
                        f"{summary / 2**20:>9.0f}Mi{gather / 2**20:>10.0f}Mi{summary / gather:>8.3f}"
                    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    time_table()
    bytes_table()
