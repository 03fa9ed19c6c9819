"""CP layouts for 131,072-token packs: contiguous vs per-document zigzag vs balanced, side by side.

1. Acceptance of ``balanced`` on all 90 (pack kind, CP, seed) cases of ``packs.py`` (CP 8, 16,
   32; ten seeds): the worst causal-pair and token imbalance (max/mean over ranks), K/V rows
   received summed over ranks as a fraction of an all-gather, planning time, and whether the
   bounds hold (pairs ≤ 1.02, tokens ≤ 1.05, zero padding, K/V ≤ the kind's bound).
2. Per strategy (worst over the ten seeds): pair and token imbalance; the per-layer step-time
   model (``CPLayout.step_time_ratio``: attention layers wait for the rank with the most pairs,
   every other layer for the rank with the most tokens) under the cost splits of Qwen3.5-35B-A3B
   and 122B-A10B; K/V as a fraction of an all-gather; the busiest rank's gated-delta-rule
   summaries per GDN layer against all-gathering that layer's q, k, v, g, beta; the padding
   Megatron's zigzag would add.

Cost split (forward FLOPs; the ratio is the same for forward + backward): one causal pair costs
``4 · heads · head_dim`` in each full-attention layer (QKᵀ and PV), one token ``2 · active
parameters``. 35B-A3B: 10 of 40 layers full attention, 16 heads of 256, ~3.0 B active; GDN 16
key / 32 value heads of 128. 122B-A10B: 12 of 48, 32 heads of 256, ~10.2 B active; GDN 16 / 64
heads of 128 (REFERENCE.md). Pure planning: runs in seconds on CPU.

    python benchmarks/bench_layouts.py
"""

from __future__ import annotations

import time

from packs import KINDS, KV_BOUND, SEEDS, cu_of, pack

from cp_varlen_attn import PAIR_BOUND, TOKEN_BOUND, plan_cp_layout, plan_summaries

CPS = (8, 16, 32)
# name: (attention layers, heads, head dim, active parameters, GDN key heads, value heads, dim)
MODELS = {
    "35B-A3B": (10, 16, 256, 3.0e9, 16, 32, 128),
    "122B-A10B": (12, 32, 256, 10.2e9, 16, 64, 128),
}


def costs(model: str) -> tuple[float, float]:
    layers, heads, dim, active, *_ = MODELS[model]
    return layers * 4 * heads * dim, 2 * active


def gdn_ratio(layout, model: str) -> float:
    """Busiest rank's summary bytes (fp32) over its all-gather of q, k, v, g, beta (bf16)."""
    *_, hk, hv, d = MODELS[model]
    summaries = max(plan_summaries(layout).summary_bytes_per_rank(hv, d, d))
    gathered = max(layout.all_gather_kv_bytes(2 * (2 * hk * d + hv * d + 2 * hv)))
    return summaries / gathered if gathered else 0.0


def acceptance() -> None:
    print("balanced on 90 packs of 131,072 tokens (worst over ten seeds)")
    header = f"{'pack':<14}{'cp':>4}{'pairs':>9}{'tokens':>8}{'K/V':>8}{'bound':>7}{'plan ms':>9}  verdict"
    print(header)
    print("-" * len(header))
    passed = 0
    for kind in KINDS:
        for cp in CPS:
            worst_pairs = worst_tokens = worst_kv = worst_ms = 0.0
            ok = 0
            for seed in SEEDS:
                cu = cu_of(pack(kind, seed))
                start = time.perf_counter()
                layout = plan_cp_layout(cu, cp)
                worst_ms = max(worst_ms, (time.perf_counter() - start) * 1e3)
                worst_pairs = max(worst_pairs, layout.pair_imbalance)
                worst_tokens = max(worst_tokens, layout.token_imbalance)
                worst_kv = max(worst_kv, layout.kv_fraction)
                ok += (
                    layout.pair_imbalance <= PAIR_BOUND
                    and layout.token_imbalance <= TOKEN_BOUND
                    and layout.padding_tokens == 0
                    and layout.kv_fraction <= KV_BOUND[kind]
                )
            passed += ok
            print(
                f"{kind:<14}{cp:>4}{worst_pairs:>9.4f}{worst_tokens:>8.4f}{worst_kv:>8.3f}"
                f"{KV_BOUND[kind]:>7.2f}{worst_ms:>9.1f}  {ok}/{len(SEEDS)} within bounds"
            )
    print(f"{passed} of {len(KINDS) * len(CPS) * len(SEEDS)} cases within every bound\n")


def side_by_side() -> None:
    print("per strategy (worst over ten seeds); step = per-layer step-time model / ideal")
    header = (
        f"{'pack':<14}{'cp':>4}  {'strategy':<11}{'pairs':>7}{'tokens':>8}"
        f"{'step 35B':>10}{'step 122B':>11}{'K/V':>7}{'GDN 35B':>9}{'GDN 122B':>10}{'padding':>9}"
    )
    print(header)
    print("-" * len(header))
    for kind in KINDS:
        for cp in CPS:
            for strategy in ("contiguous", "zigzag", "balanced"):
                rows = []
                for seed in SEEDS:
                    layout = plan_cp_layout(cu_of(pack(kind, seed)), cp, strategy=strategy)
                    rows.append(
                        (
                            layout.pair_imbalance,
                            layout.token_imbalance,
                            layout.step_time_ratio(*costs("35B-A3B")),
                            layout.step_time_ratio(*costs("122B-A10B")),
                            layout.kv_fraction,
                            gdn_ratio(layout, "35B-A3B"),
                            gdn_ratio(layout, "122B-A10B"),
                            layout.padding_tokens,
                        )
                    )
                w = [max(col) for col in zip(*rows, strict=True)]
                print(
                    f"{kind:<14}{cp:>4}  {strategy:<11}{w[0]:>7.3f}{w[1]:>8.3f}{w[2]:>10.3f}"
                    f"{w[3]:>11.3f}{w[4]:>7.3f}{w[5]:>9.3f}{w[6]:>10.3f}{w[7]:>9d}"
                )


if __name__ == "__main__":
    acceptance()
    side_by_side()
