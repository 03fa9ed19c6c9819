"""CPU time of varlen_attention at CP=4 (gloo) against the dense-mask reference, in one run.

The reference is what a stack without varlen support does: one SDPA over the whole packed
sequence with a dense [S, S] block-diagonal causal mask. varlen_attention runs on 4 gloo ranks
(balanced layout); we report the slowest rank's forward+backward CPU time (process time,
since this machine has fewer cores than ranks), and the single-rank (CP=1) packed path. Same documents, same fp32 inputs.

    python benchmarks/bench_attention.py [--seq 4096]
"""

from __future__ import annotations

import argparse
import itertools
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_varlen_attn import plan_cp_layout, shard_sequence, varlen_attention
from dist_testkit import run_ranks

HEADS, KV_HEADS, DIM, REPEAT = 8, 2, 64, 3


def lengths_for(seq: int) -> list[int]:
    rng = random.Random(0)
    out: list[int] = []
    while sum(out) < seq:
        out.append(max(1, min(int(rng.lognormvariate(5.5, 1.2)), seq // 2)))
    out[-1] -= sum(out) - seq
    return [n for n in out if n > 0]


def inputs(seq: int):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(seq, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))


def time_fwd_bwd(fn, *tensors) -> float:
    best = float("inf")
    for _ in range(REPEAT):
        xs = [t.detach().clone().requires_grad_() for t in tensors]
        start = time.process_time()
        fn(*xs).sum().backward()
        best = min(best, time.process_time() - start)
    return best


def dense_reference(seq: int, cu: list[int]) -> float:
    doc = torch.zeros(seq, dtype=torch.long)
    for i, (s, e) in enumerate(itertools.pairwise(cu)):
        doc[s:e] = i
    pos = torch.arange(seq)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])  # [S, S]

    def attend(q, k, v):
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            enable_gqa=True,
        )

    return time_fwd_bwd(attend, *inputs(seq))


def varlen_rank(seq: int, cu: list[int]) -> float:
    group = dist.group.WORLD if dist.is_initialized() else None
    cp, rank = (dist.get_world_size(), dist.get_rank()) if group is not None else (1, 0)
    layout = plan_cp_layout(cu, cp)
    q, k, v = (shard_sequence(x, layout, rank, dim=0) for x in inputs(seq))
    if group is not None:
        dist.barrier()
    return time_fwd_bwd(
        lambda q, k, v: varlen_attention(q[None], k[None], v[None], layout, group), q, k, v
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = lengths_for(args.seq)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    dense = dense_reference(args.seq, cu)
    cp1 = varlen_rank(args.seq, cu)
    cp4 = max(run_ranks(varlen_rank, 4, args.seq, cu, timeout=600))
    print(
        f"S={args.seq}, {len(lengths)} documents (longest {max(lengths)}), heads {HEADS}/{KV_HEADS}, dim {DIM}, fp32, 1 thread per process"
    )
    print(f"{'variant':<34}{'fwd+bwd CPU s':>14}{'vs dense':>10}")
    for name, t in (
        ("dense [S,S] mask SDPA (1 process)", dense),
        ("varlen_attention CP=1", cp1),
        ("varlen_attention CP=4 (slowest)", cp4),
    ):
        print(f"{name:<34}{t:>14.3f}{dense / t:>9.2f}x")


if __name__ == "__main__":
    main()
