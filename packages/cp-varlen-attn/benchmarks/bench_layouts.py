"""Layout quality for 128K packs: contiguous vs per-document zigzag vs balanced, side by side.

For CP = 4, 8, 32 and three kinds of pack — (a) long-tailed document lengths, (b) one 128K
document, (c) one long video-like document plus many short ones — prints per strategy: compute
imbalance (max/mean of the default cost model: causal attention + per-token linear work), token
imbalance, the same two when the layout is planned and measured with attention-only cost, per-document padding
that the strategy needs, and K/V received per rank when only the needed pieces are sent, as a
fraction of an all-gather. Pure planning: runs in seconds on CPU.

    python benchmarks/bench_layouts.py
"""

from __future__ import annotations

import random

from cp_varlen_attn import plan_cp_layout

SEQ = 131072


def long_tailed(seed: int) -> list[int]:
    """Log-normal lengths (median ~900 tokens, a long tail up to 32K): web-text-like packs."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < SEQ:
        lengths.append(max(1, min(int(rng.lognormvariate(6.8, 1.3)), 32768)))
    lengths[-1] -= sum(lengths) - SEQ
    return [n for n in lengths if n > 0]


def one_document() -> list[int]:
    return [SEQ]


def video_plus_short(seed: int) -> list[int]:
    rng = random.Random(seed)
    lengths = [65536 + 8192]
    while sum(lengths) < SEQ:
        lengths.append(rng.randint(64, 2048))
    lengths[-1] -= sum(lengths) - SEQ
    return [n for n in lengths if n > 0]


def cu_of(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def main() -> None:
    packs = {
        "long-tailed": long_tailed(0),
        "one 128K doc": one_document(),
        "video + short": video_plus_short(0),
    }
    header = f"{'pack':<14}{'cp':>4}  {'strategy':<11}{'compute':>9}{'tokens':>8}{'attn-only':>11}{'tokens':>8}{'padding':>9}{'KV/all-gather':>15}"
    print(header)
    print("-" * len(header))
    for name, lengths in packs.items():
        for cp in (4, 8, 32):
            for strategy in ("contiguous", "zigzag", "balanced"):
                layout = plan_cp_layout(cu_of(lengths), cp, strategy=strategy)
                attn_only = plan_cp_layout(cu_of(lengths), cp, strategy=strategy, token_weight=0.0)
                needed = sum(layout.kv_bytes(1))
                gathered = sum(layout.all_gather_kv_bytes(1))
                print(
                    f"{name:<14}{cp:>4}  {strategy:<11}{layout.compute_imbalance():>9.3f}"
                    f"{layout.token_imbalance():>8.3f}{attn_only.compute_imbalance():>11.3f}"
                    f"{attn_only.token_imbalance():>8.3f}{layout.padding_tokens:>9d}{needed / gathered:>15.3f}"
                )
        print(f"{'':<14}({len(lengths)} documents, longest {max(lengths)})")


if __name__ == "__main__":
    main()
