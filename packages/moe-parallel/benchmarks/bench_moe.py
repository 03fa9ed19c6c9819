"""MoE dispatch volume, dropped tokens and grouped-GEMM expert compute vs a per-expert loop.

Run: OMP_NUM_THREADS=1 python benchmarks/bench_moe.py   (CPU, about a minute)

1. Bytes a rank sends per token in the forward dispatch of ``all_to_all_expert_compute``
   (rows + the [P, L] int64 count exchange), from the same ``dispatch_splits`` the layer uses,
   vs the minimum top_k * hidden * dtype_size and vs the naive all-gather of every token to
   every EP rank (P * hidden * dtype_size).
2. Tokens dropped by a forward of ``MoE`` (rows the experts computed vs N * top_k).
3. fp32 CPU time of the routed-expert forward+backward at 256 experts / top-8 (width scaled
   down): this package's grouped GEMM vs its exact per-expert loop vs a transformers-style
   loop over hit experts with index_add.
4. Dequantizing an FP8 expert weight (64 experts' gate/up [64, 1024, 512], 128 x 128 blocks,
   to bf16, one CPU thread): the by-hand formula with torch's float8 conversion vs
   ``dequantize``'s per-block tables (the same bits, checked), ns per element.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from moe_parallel import BlockFormat, MoE, dequantize, expert_swiglu, quantize
from moe_parallel.dispatch import dispatch_splits
from moe_parallel.grouped import grouped_mm_works, loop_linear

EXPERTS, TOP_K, HIDDEN, INTER, TOKENS = 256, 8, 128, 64, 4096


def dispatch_table() -> list[tuple]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for ep in (8, 32, 256):
        logits = torch.randn(TOKENS, EXPERTS, generator=g)
        top_i = torch.topk(logits, TOP_K, dim=-1).indices
        counts_PL = dispatch_splits(torch.bincount(top_i.reshape(-1), minlength=EXPERTS), ep)
        dsize = 2  # bf16 activations
        sent = int(counts_PL.sum()) * HIDDEN * dsize + counts_PL.numel() * 8
        per_token = sent / TOKENS
        minimum = TOP_K * HIDDEN * dsize
        naive = ep * HIDDEN * dsize
        rows.append((ep, per_token, minimum, per_token / minimum, naive / per_token))
    return rows


def dropped() -> tuple[int, int]:
    torch.manual_seed(0)
    moe = MoE(HIDDEN, EXPERTS, TOP_K, INTER, 0)
    seen = []
    orig = moe.experts.forward

    def counting(x_NH, top_i_NK):
        out = orig(x_NH, top_i_NK)
        seen.append(int((out.abs().sum(-1) > 0).sum()))
        return out

    moe.experts.forward = counting
    with torch.no_grad():
        moe(torch.randn(1, TOKENS, HIDDEN))
    return TOKENS * TOP_K, seen[0]


def hf_style(x_NH, top_i_NK, gate_up, down):
    out = x_NH.new_zeros(x_NH.shape[0], TOP_K, HIDDEN)
    for e in torch.unique(top_i_NK).tolist():
        tok, slot = torch.where(top_i_NK == e)
        gate, up = F.linear(x_NH[tok], gate_up[e]).chunk(2, dim=-1)
        out = out.index_put((tok, slot), F.linear(F.silu(gate) * up, down[e]))
    return out


def sorted_rows(x_NH, top_i_NK, fn):
    flat = top_i_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=EXPERTS)
    return fn(x_NH[order // TOP_K], counts)[torch.argsort(order)]


def timed(fn, reps=5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def compute_table() -> list[tuple[str, float]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, generator=g, requires_grad=True)
    top_i = torch.topk(torch.randn(TOKENS, EXPERTS, generator=g), TOP_K, dim=-1).indices
    gate_up = (0.05 * torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g)).requires_grad_()
    down = (0.05 * torch.randn(EXPERTS, HIDDEN, INTER, generator=g)).requires_grad_()

    def exact_loop(rows, counts):
        c = counts.tolist()
        gate, up = loop_linear(rows, c, gate_up).chunk(2, dim=-1)
        return loop_linear(F.silu(gate) * up, c, down)

    # Name what the "grouped" variant really runs: a failing probe would silently time the loop.
    grouped = "torch._grouped_mm" if grouped_mm_works(x, HIDDEN, INTER) else "loop: probe failed"
    variants = {
        f"expert_swiglu ({grouped})": lambda: sorted_rows(
            x, top_i, lambda r, c: expert_swiglu(r, c, gate_up, down, backend="torch")
        ),
        "per-expert loop (fallback)": lambda: sorted_rows(x, top_i, exact_loop),
        "loop over hit experts (HF-style)": lambda: hf_style(x, top_i, gate_up, down).reshape(
            -1, HIDDEN
        ),
    }
    ref = variants["loop over hit experts (HF-style)"]().detach()
    results = []
    for name, fn in variants.items():
        torch.testing.assert_close(fn().detach(), ref, rtol=1e-4, atol=1e-5)

        def step(fn=fn):
            fn().square().sum().backward()

        results.append((name, timed(step)))
    return results


def dequantize_table() -> list[tuple[str, float]]:
    form = BlockFormat((128, 128), parts=2)
    g = torch.Generator().manual_seed(2)
    data, scale = quantize(0.02 * torch.randn(64, 1024, 512, generator=g), form)

    def by_hand():
        s = scale.view(64, 8, 1, 4, 1).expand(64, 8, 128, 4, 128).reshape(data.shape)
        return (data.to(torch.float32) * s).to(torch.bfloat16)

    def tables():
        return dequantize(data, scale, form, dtype=torch.bfloat16)

    assert torch.equal(by_hand().view(torch.int16), tables().view(torch.int16))
    n = data.numel()
    return [
        ("torch's float8 conversion", timed(by_hand) / n),
        ("per-block tables", timed(tables) / n),
    ]


def main() -> None:
    torch.set_num_threads(1)
    print(
        f"1. dispatch bytes/token ({EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, bf16, {TOKENS} tokens)"
    )
    print("| EP | sent B/token | minimum B/token | sent / minimum | all-gather / sent |")
    print("|---:|---:|---:|---:|---:|")
    for ep, sent, minimum, ratio, naive in dispatch_table():
        print(f"| {ep} | {sent:.1f} | {minimum} | {ratio:.4f} | {naive:.2f} |")
    want, got = dropped()
    print(f"\n2. tokens dropped: {want - got} of {want} (token, expert) assignments")
    print(
        f"\n3. routed experts fwd+bwd, fp32 CPU, 1 thread ({TOKENS} tokens, {EXPERTS} experts, "
        f"top-{TOP_K}, hidden {HIDDEN}, expert width {INTER})"
    )
    results = compute_table()
    base = results[-1][1]
    print("| variant | time (ms) | speed-up vs HF-style loop |")
    print("|---|---:|---:|")
    for name, t in results:
        print(f"| {name} | {t * 1e3:.1f} | {base / t:.2f}x |")
    print("\n4. FP8 dequantize, [64, 1024, 512] in 128 x 128 blocks to bf16, 1 thread")
    rows = dequantize_table()
    print("| decode | ns / element | speed-up vs torch's conversion |")
    print("|---|---:|---:|")
    for name, t in rows:
        print(f"| {name} | {t * 1e9:.2f} | {rows[0][1] / t:.2f}x |")


if __name__ == "__main__":
    main()
