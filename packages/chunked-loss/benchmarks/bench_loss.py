"""Linear cross-entropy side by side: naive, this package, and the peers, in ONE invocation.

Variants (``--variants`` picks a subset):
- ``naive``: ``F.cross_entropy((h @ w.T).float(), y)`` on full logits;
- ``chunked-loss``: ``chunked_loss.linear_cross_entropy`` as shipped (gradients in forward,
  compiled per-chunk kernels, oneDNN matmuls on CPU); ``chunked-loss-eager``: the same with
  ``compiled=False``; ``chunked-loss-aten``: the same with ``CHUNKED_LOSS_CPU_MATMUL=aten``
  (the CPU matmuls on aten's mm, MKL, as every peer's are; CPU only);
  ``recompute``: ``grad_in_forward=False`` (not run by default);
- ``torchtitan``: ``torchtitan.components.loss.ChunkedLossWrapper`` (8 chunks, its default)
  around an ``nn.Linear`` lm_head holding the same weight;
- ``torchtune``: ``torchtune.modules.loss.CEWithChunkedOutputLoss`` (8 chunks, its default) on
  ``F.linear`` of each hidden chunk, as its docstring shows (eager, its recipes' default);
- ``cce``: Cut Cross-Entropy ``linear_cross_entropy(..., impl="torch_compile")``;
- GPU only: ``cce-triton`` (``impl="cce"``) and ``liger`` (Liger-Kernel's fused linear CE).

Every (variant, N, H) runs in a fresh subprocess: the variant's library is imported (``PRELOAD``),
inputs are made (hidden [N, H], weight [V, H], both requiring grad; 10 % of labels ignored), then
two forward+backward calls. Memory is the
peak above the inputs over both calls — on CPU the RSS high-water mark (``VmHWM``, reset after the
inputs exist) minus the RSS then, on CUDA the allocator's peak minus the bytes then allocated;
it includes the weight and hidden gradients (every variant makes them) and, for compiled
variants, whatever compiling costs in the first call. Time is the SECOND call's. A variant whose
estimated peak exceeds the free memory is skipped with that reason; one that cannot be
imported or fails is reported with its error (``FREE_FRACTION``: the share of free memory a
variant may take). ``--rounds R`` runs the whole set R times, interleaved, and keeps each
variant's fastest second call and largest peak: on a shared machine the other jobs' load
changes from one variant to the next. Ratios are against the fastest peer (time) and
that same peer (memory); the last lines check the package against the issue's targets.

    python benchmarks/bench_loss.py --tokens 4096 --hidden 1024      # the target point
    python benchmarks/bench_loss.py                                  # N 2048/4096/8192 × H 1024/3072
    python benchmarks/bench_loss.py --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

MIB = 1 << 20
# A variant runs only if its estimated peak is below this share of the free memory: the rest is
# left to whatever else runs on the machine.
FREE_FRACTION = 0.7
PEERS = ("torchtitan", "torchtune", "cce", "cce-triton", "liger")
GPU_ONLY = ("cce-triton", "liger")
DEFAULT = (
    "naive",
    "chunked-loss",
    "chunked-loss-eager",
    "chunked-loss-aten",
    "torchtitan",
    "torchtune",
    "cce",
)
# Environment a variant's subprocess runs with.
ENVIRONMENT = {"chunked-loss-aten": {"CHUNKED_LOSS_CPU_MATMUL": "aten"}}
CPU_ONLY = ("chunked-loss-aten",)  # the same code as "chunked-loss" on a GPU


def naive(h, w, y):
    return F.cross_entropy((h @ w.T).float(), y)


def chunked(h, w, y, **kw):
    from chunked_loss import linear_cross_entropy

    return linear_cross_entropy(h, w, y, **kw)


def torchtitan(h, w, y):
    from torch import nn
    from torchtitan.components.loss import ChunkedLossWrapper

    head = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    head.weight = w  # the benchmark's Parameter: its .grad is read like every other variant's
    loss_fn = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=8))
    loss_fn.set_lm_head(head)
    loss, _ = loss_fn(h[None], y[None], global_valid_tokens=(y != -100).sum())
    return loss


def torchtune(h, w, y):
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=8)
    return loss_fn([F.linear(c, w) for c in h[None].chunk(8, dim=1)], y[None])


def cce(h, w, y, impl="torch_compile"):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, y, impl=impl)


def liger(h, w, y):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(h, w, y)


VARIANTS = {
    "naive": naive,
    "chunked-loss": chunked,
    "chunked-loss-eager": lambda h, w, y: chunked(h, w, y, compiled=False),
    "chunked-loss-aten": chunked,  # with ENVIRONMENT's backend choice
    "recompute": lambda h, w, y: chunked(h, w, y, grad_in_forward=False),
    "torchtitan": torchtitan,
    "torchtune": torchtune,
    "cce": cce,
    "cce-triton": lambda h, w, y: cce(h, w, y, impl="cce"),
    "liger": liger,
}


# Imported before the baseline is taken: importing a library is not part of a call's working set
# (Dynamo/Inductor's modules for the compiled variants, so their first call counts what
# compiling itself allocates, not the imports).
PRELOAD = {
    "chunked-loss": ("chunked_loss", "torch._inductor.compile_fx"),
    "chunked-loss-eager": ("chunked_loss",),
    "chunked-loss-aten": ("chunked_loss", "torch._inductor.compile_fx"),
    "recompute": ("chunked_loss", "torch._inductor.compile_fx"),
    "torchtitan": ("torchtitan.components.loss",),
    "torchtune": ("torchtune.modules.loss",),
    "cce": ("cut_cross_entropy", "torch._inductor.compile_fx"),
    "cce-triton": ("cut_cross_entropy",),
    "liger": ("liger_kernel.transformers.functional",),
}


def estimate_bytes(variant: str, n: int, h: int, v: int, size: int) -> int:
    """Rough peak above the inputs, from this script's own CPU fp32 measurements at N = 4096
    (naive 3, torchtune 2, CCE 1.1, torchtitan 0.55 [N, V] fp32 tensors, plus the gradients),
    used only to skip variants that cannot fit."""
    grads = (v + n) * h * 4
    full = n * v * 4
    per_variant = {
        "naive": 3 * full,
        "torchtune": 2 * full,
        "cce": full + full // 10,
        "torchtitan": full // 2 + full // 20,
        "liger": 2 * n * h * size,
        "cce-triton": n * 8,
    }
    return grads + per_variant.get(variant, 512 * MIB)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(variant: str, n: int, h_dim: int, vocab: int, device: str, dtype: str) -> None:
    for module in PRELOAD.get(variant, ()):
        importlib.import_module(module)
    torch.manual_seed(0)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    hidden = torch.randn(n, h_dim, device=device, dtype=dt, requires_grad=True)
    weight = torch.nn.Parameter((torch.randn(vocab, h_dim, device=device) / h_dim**0.5).to(dt))
    labels = torch.randint(0, vocab, (n,), device=device)
    labels[torch.rand(n, device=device) < 0.1] = -100
    fn = VARIANTS[variant]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss()
        _reset_hwm()
    times, loss = [], None
    for _ in range(2):
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        loss = fn(hidden, weight, labels)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if cuda else _hwm()) - base
    result = {
        "peak": peak,
        "time": times[1],
        "first": times[0],
        "loss": float(loss),
        "grad_h": float(hidden.grad.float().norm()),
        "grad_w": float(weight.grad.float().norm()),
        "load": os.getloadavg()[0],
    }
    print(json.dumps(result))


def run_variant(args, variant: str, n: int, h_dim: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--tokens", str(n)]
    cmd += ["--hidden", str(h_dim), "--vocab", str(args.vocab), "--device", args.device]
    cmd += ["--dtype", args.dtype, "--threads", str(args.threads)]
    try:
        env = {**os.environ, **ENVIRONMENT.get(variant, {})}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return {"error": f"failed (exit {proc.returncode}): {lines[-1] if lines else 'no output'}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def unavailable(variant: str, device: str) -> str | None:
    """Why a variant cannot run here (not installed, needs a GPU), or None."""
    if variant in GPU_ONLY and not device.startswith("cuda"):
        return "needs a GPU (Triton kernels)"
    if variant in CPU_ONLY and device.startswith("cuda"):
        return "the same as chunked-loss on a GPU (aten matmuls there)"
    if variant not in PEERS:
        return None
    probe = [sys.executable, "-c", f"import {PRELOAD[variant][0]}"]
    proc = subprocess.run(probe, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return f"does not import ({lines[-1] if lines else 'error'}); `uv sync --group bench`"
    return None


def free_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 3072])
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(DEFAULT))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per variant subprocess")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every variant this many times, interleaved; report the fastest timed call "
        "and the largest peak (damps the load of other jobs on a shared machine)",
    )
    p.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        worker(args.worker, args.tokens[0], args.hidden[0], args.vocab, args.device, args.dtype)
        return
    variants = list(args.variants)
    if args.device.startswith("cuda"):
        variants += [v for v in GPU_ONLY if v not in variants]
    missing = {v: unavailable(v, args.device) for v in variants}
    size = {"fp32": 4, "bf16": 2}[args.dtype]
    print(
        f"device={args.device} dtype={args.dtype} V={args.vocab} threads={args.threads} "
        f"torch={torch.__version__}; time = 2nd forward+backward"
        + (f" (fastest of {args.rounds} rounds)" if args.rounds > 1 else "")
        + ", peak = above the inputs"
    )
    header = (
        f"| {'N':>5} | {'H':>5} | {'variant':<18} | {'peak MiB':>9} | {'time s':>7} | "
        f"{'mem/peer':>8} | {'time/peer':>9} | {'loss':>8} | {'norm dW':>9} | {'load':>4} |"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    summary = []
    for h_dim in args.hidden:
        for n in args.tokens:
            results = {}
            for round_ in range(args.rounds):
                for v in variants:
                    if "error" in results.get(v, {}):
                        continue
                    need = estimate_bytes(v, n, h_dim, args.vocab, size)
                    if missing[v]:
                        results[v] = {"error": f"skipped: {missing[v]}"}
                    elif need > FREE_FRACTION * free_bytes(args.device):
                        results[v] = {
                            "error": f"skipped: needs ~{need / MIB:,.0f} MiB, "
                            f"{free_bytes(args.device) / MIB:,.0f} MiB free"
                        }
                    else:
                        r = run_variant(args, v, n, h_dim)
                        if "error" not in r:
                            print(
                                f"  (round {round_ + 1}: {v} N={n} H={h_dim}: "
                                f"{r['peak'] / MIB:,.0f} MiB, {r['time']:.1f} s, first call "
                                f"{r['first']:.1f} s)",
                                file=sys.stderr,
                                flush=True,
                            )
                        results[v] = _merge(results.get(v), r)
            summary.append(_print_rows(n, h_dim, results))
    print(
        "mem/peer, time/peer: this row / the fastest peer at that (N, H); peers = "
        + ", ".join(v for v in variants if v in PEERS)
    )
    for line in summary:
        if line:
            print(line)


def _merge(best: dict | None, new: dict) -> dict:
    """Over rounds: the fastest timed call (with its load) and the largest peak; an error
    in any round is reported."""
    if best is None or "error" in new:
        return new
    fastest = new if new["time"] < best["time"] else best
    return {**fastest, "peak": max(best["peak"], new["peak"])}


def _print_rows(n: int, h_dim: int, results: dict) -> str | None:
    ran = {v: r for v, r in results.items() if "error" not in r}
    peers = {v: r for v, r in ran.items() if v in PEERS}
    best = min(peers, key=lambda v: peers[v]["time"]) if peers else None
    for v, r in results.items():
        if "error" in r:
            print(f"| {n:>5} | {h_dim:>5} | {v:<18} | {r['error']}")
            continue
        mem = time_ratio = "-"
        if best:
            mem = f"{r['peak'] / peers[best]['peak']:.2f}x"
            time_ratio = f"{r['time'] / peers[best]['time']:.2f}x"
        print(
            f"| {n:>5} | {h_dim:>5} | {v:<18} | {r['peak'] / MIB:>9,.0f} | {r['time']:>7.2f} | "
            f"{mem:>8} | {time_ratio:>9} | {r['loss']:>8.5f} | {r['grad_w']:>9.6f} | "
            f"{r['load']:>4.1f} |",
            flush=True,
        )
    ours = ran.get("chunked-loss")
    if not (ours and best):
        return None
    others = [v for v in peers if v != best]
    worst_other = max((ours["peak"] / peers[v]["peak"] for v in others), default=0.0)
    return (
        f"N={n} H={h_dim}: chunked-loss time {ours['time'] / peers[best]['time']:.2f}x the fastest "
        f"peer ({best}; target <= 0.95x), memory {ours['peak'] / peers[best]['peak']:.2f}x "
        f"{best}'s (target <= 0.33x) and at most {worst_other:.2f}x any other peer's "
        "(target <= 0.50x)"
    )


if __name__ == "__main__":
    main()
