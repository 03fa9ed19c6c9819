"""Naive ``F.cross_entropy`` on full logits vs ``chunked_loss.linear_cross_entropy``, both in
its default mode (``chunked-loss``: gradients formed in the forward) and with
``grad_in_forward=False`` (``recompute``: backward recomputes each chunk's logits).

Each (variant, N) runs in a fresh subprocess, so peak memory is that variant's alone:
- CPU: peak RSS (``ru_maxrss``) minus the RSS once the inputs exist;
- CUDA: ``torch.cuda.max_memory_allocated`` minus the bytes allocated once the inputs exist.
Both include the gradients of hidden and weight (the same for every variant). Time is the mean
wall time of the forward+backward passes after a first (memory-measuring) one, or of that
first one with ``--repeats 0``. Peers (Liger-Kernel's fused linear cross-entropy, Cut
Cross-Entropy) are run when importable (they need a GPU).

    python benchmarks/bench_loss.py                      # CPU, fp32, N = 2048 and 4096
    python benchmarks/bench_loss.py --tokens 2048 8192 --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

GIB = 1 << 30


def naive(h, w, y):
    return F.cross_entropy((h @ w.T).float(), y)


def chunked(h, w, y):
    """The default: gradients computed during the forward (3 matmuls, like naive)."""
    from chunked_loss import linear_cross_entropy

    return linear_cross_entropy(h, w, y)


def recompute(h, w, y):
    """Forward keeps the log-sum-exp only; backward recomputes each chunk (4 matmuls)."""
    from chunked_loss import linear_cross_entropy

    return linear_cross_entropy(h, w, y, grad_in_forward=False)


def liger(h, w, y):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(h, w, y)


def cce(h, w, y):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, y)


VARIANTS = {
    "naive": naive,
    "chunked-loss": chunked,
    "recompute": recompute,
    "liger": liger,
    "cce": cce,
}
PEER_MODULES = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(variant: str, n: int, h_dim: int, vocab: int, device: str, dtype: str, repeats: int):
    torch.manual_seed(0)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    hidden = torch.randn(n, h_dim, device=device, dtype=dt, requires_grad=True)
    weight = (torch.randn(vocab, h_dim, device=device) / h_dim**0.5).to(dt).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device=device)
    labels[::7] = -100
    fn = VARIANTS[variant]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    times, loss = [], None
    for _ in range(1 + repeats):
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        loss = fn(hidden, weight, labels)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if len(times) == 1:
            if cuda:
                peak = torch.cuda.max_memory_allocated() - base
            else:
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    timed = times[1:] or times
    load = os.getloadavg()[0]
    print(
        json.dumps(
            {"peak": peak, "time": sum(timed) / len(timed), "loss": float(loss), "load": load}
        )
    )


def run_variant(args, variant: str, n: int) -> dict | None:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--tokens",
        str(n),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  {variant} N={n} failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", choices=list(VARIANTS))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        for n in args.tokens:
            worker(args.worker, n, args.hidden, args.vocab, args.device, args.dtype, args.repeats)
        return
    variants = ["naive", "chunked-loss", "recompute"]
    for peer, module in PEER_MODULES.items():
        try:
            __import__(module)
        except ImportError:
            print(f"(peer {peer} skipped: {module} is not installed)")
            continue
        if args.device.startswith("cuda"):
            variants.append(peer)
        else:
            print(f"(peer {peer} skipped: it needs a GPU)")
    print(
        f"device={args.device} dtype={args.dtype} H={args.hidden} V={args.vocab} "
        f"threads={args.threads} repeats={args.repeats}"
    )
    header = f"| {'N':>5} | {'variant':<12} | {'peak extra GiB':>14} | {'fwd+bwd s':>9} | {'mem ratio':>9} | {'time ratio':>10} | {'loss':>8} | {'load':>5} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for n in args.tokens:
        results = {v: run_variant(args, v, n) for v in variants}
        base = results["naive"]
        for v, r in results.items():
            if r is None:
                print(
                    f"| {n:>5} | {v:<12} | {'failed':>14} | {'':>9} | {'':>9} | {'':>10} | {'':>8} | {'':>5} |"
                )
                continue
            mem_ratio = f"{base['peak'] / r['peak']:.1f}x" if base else "-"
            time_ratio = f"{r['time'] / base['time']:.2f}x" if base else "-"
            print(
                f"| {n:>5} | {v:<12} | {r['peak'] / GIB:>14.2f} | {r['time']:>9.2f} | "
                f"{mem_ratio:>9} | {time_ratio:>10} | {r['loss']:>8.4f} | {r['load']:>5.1f} |",
                flush=True,
            )
    print(
        "mem ratio = naive peak / variant peak (higher is better); "
        "time ratio = variant time / naive time (lower is better); "
        "load = 1-min load average when the variant finished"
    )


if __name__ == "__main__":
    main()
