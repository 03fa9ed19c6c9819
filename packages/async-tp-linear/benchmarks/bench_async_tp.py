"""Time a compiled TP + sequence-parallel MLP step with and without async TP (GPU only).

Rows, all in one run on all visible GPUs (one TP group over them, NCCL):

- ``nn.Linear, async TP off``   the baseline: plain TP + SP, compiled;
- ``nn.Linear, async TP on``    the flag set on layers the pass cannot match (bias → addmm);
- ``TPLinear, async TP on``     this package: the pass fuses all-gather→mm and mm→reduce-scatter.

Each row reports the fused sites found in its compiled graphs (``find_fusion_patterns``), the
median forward+backward step time, and the ratio to the baseline. The async-TP speed-up is a
GPU/NVLink property: on CPU, or with fewer than two GPUs, the script prints why and exits 0.

    python benchmarks/bench_async_tp.py [--hidden 4096] [--ffn 14336] [--seq 8192] [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    return p.parse_args()


def _rank_main(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from async_tp_linear import enable_async_tp, find_fusion_patterns, swap_tp_linears

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(args.hidden)
            self.up = nn.Linear(args.hidden, args.ffn)
            self.down = nn.Linear(args.ffn, args.hidden)

        def forward(self, x):
            return self.down(torch.relu(self.up(self.norm(x))))

    def plan():
        return {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        }

    def build(use_tp_linear: bool):
        torch.manual_seed(0)
        model = MLP().to(device="cuda", dtype=torch.bfloat16)
        if use_tp_linear:
            swap_tp_linears(model, plan())
        parallelize_module(model, mesh, plan())
        return model

    x = torch.randn(args.batch, args.seq // world, args.hidden, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_()

    def step(model):
        out = model(x)
        out.float().square().mean().backward()

    def run(name: str, use_tp_linear: bool):
        sites = []
        with inductor_config.patch(
            force_disable_caches=True,
            post_grad_custom_post_pass=lambda g: sites.extend(find_fusion_patterns(g)),
        ):
            model = torch.compile(build(use_tp_linear))
            for _ in range(args.warmup):
                step(model)
        times = []
        for _ in range(args.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(model)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        fused = sum(s.status == "fused" for s in sites)
        return name, fused, len(sites), statistics.median(times)

    rows = [run("nn.Linear, async TP off", use_tp_linear=False)]
    enable_async_tp(mesh, sequence_parallel=True)
    rows.append(run("nn.Linear, async TP on", use_tp_linear=False))
    rows.append(run("TPLinear, async TP on", use_tp_linear=True))
    if rank == 0:
        base = rows[0][3]
        print(
            f"TP={world} batch={args.batch} seq={args.seq} hidden={args.hidden} ffn={args.ffn} "
            f"bf16, fwd+bwd, median of {args.iters}"
        )
        print(f"{'config':<26}{'fused/sites':>12}{'ms/step':>10}{'speed-up':>10}")
        for name, fused, total, ms in rows:
            print(f"{name:<26}{f'{fused}/{total}':>12}{ms:>10.2f}{base / ms:>9.3f}x")
    dist.destroy_process_group()


def main() -> int:
    args = _parse()
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("skip: async TP needs CUDA GPUs with NCCL; none here (the speed claim is GPU-only)")
        return 0
    world = torch.cuda.device_count()
    if world < 2:
        print(f"skip: async TP needs a TP group of >= 2 GPUs, found {world}")
        return 0
    if not dist.is_nccl_available():
        print("skip: this torch build has no NCCL")
        return 0
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(world, args, port), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
