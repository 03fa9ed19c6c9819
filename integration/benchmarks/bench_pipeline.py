"""Pipeline parallelism against data parallelism on the same 4 CPU ranks, in one run: PP 2 × DP 2
(1F1B) vs DP 4 (FSDP2), the same model, rows and micro-batches; and PP 2 × DP 2 as it ran
before, each micro-batch's row padded to its capacity and the padding run through every layer
(the row's fill is printed: the rows here are about 70 % full).

Per layout: the median step time (after the first), the peak RSS of each rank's process, the
bytes the pipeline's P2P sends carry (counted in torch's batched sends), and the share of the
step each rank spends waiting in the schedule's P2P (measured around torch's waits) against the
planner's bubble (``qwen35-train plan``: ``(pp - 1) / (m + pp - 1)``) and its P2P bytes. On CPU
ranks sharing 2 cores the waits include the peer's compute time slices; the ratios, not the
seconds, are the result.

    python benchmarks/bench_pipeline.py
"""

from __future__ import annotations

import resource
import statistics
import time

import torch
import torch.distributed as dist

from dist_testkit import named_check, run_checks
from qwen35_trainer import load_recipe, train
from qwen35_trainer.plan import plan

MIB = 1 << 20
STEPS = 4
MICRO = 4
COMMON = (
    "model.text.hidden_size=128",
    "model.text.num_hidden_layers=8",
    "model.text.layer_types=[linear_attention, linear_attention, linear_attention, "
    "full_attention, linear_attention, linear_attention, linear_attention, full_attention]",
    "model.text.num_experts=16",
    "model.text.moe_intermediate_size=64",
    "model.text.shared_expert_intermediate_size=64",
    "model.vision.out_hidden_size=128",
    "data.path=null",
    "data.processor=null",
    "data.eval_path=null",
    "data.packing=true",
    "data.pack_length=512",
    "data.samples_per_rank=8",
    "data.text_tokens=[30, 50]",
    f"train.grad_accum_steps={MICRO}",
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "parallel.cp=1",
    "parallel.ep=1",
)
PP2 = ("parallel.dp=2", "parallel.pp=2", "data.samples_per_rank=16")
# name -> (overrides, whether each row is padded to its capacity and the padding computed)
LAYOUTS = {
    "DP 4": (("parallel.dp=4", "parallel.pp=1"), False),
    "PP 2 x DP 2": (PP2, False),
    "PP padded": (PP2, True),
}


def _measure(overrides: tuple[str, ...], padded: bool) -> dict:
    """On every rank: step seconds, peak RSS, P2P bytes sent and seconds waited per step, and
    the rows' fill (``padded``: every row padded to its capacity, as before)."""
    from torch.distributed.pipelining import schedules

    import qwen35_trainer.data.feed as feed

    sent, waited, filled = [0], [0.0], []
    batch, wait, pack, fits = schedules._batch_p2p, schedules._wait_batch_p2p, feed.pack, None

    def recording_pack(docs, *args, capacity=None, **kwargs):
        filled.append(sum(len(d) for d in docs) / capacity)
        return pack(docs, *args, capacity=capacity, **kwargs)

    feed.pack = recording_pack
    if padded:
        fits, feed._fits_buffers = feed._fits_buffers, lambda *_: False

    def counting_batch(ops, desc=None):
        sent[0] += sum(
            op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend
        )
        return batch(ops, desc)

    def timed_wait(work):
        began = time.perf_counter()
        wait(work)
        waited[0] += time.perf_counter() - began

    schedules._batch_p2p, schedules._wait_batch_p2p = counting_batch, timed_wait
    try:
        logs = train(load_recipe("tiny", [*COMMON, *overrides])).logs
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = batch, wait
        feed.pack = pack
        if fits is not None:
            feed._fits_buffers = fits
    seconds = [log.seconds for log in logs]
    return {
        "rank": dist.get_rank(),
        "step": statistics.median(seconds[1:]),
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "p2p": sent[0] / STEPS,
        "idle": waited[0] / sum(seconds),
        "fill": statistics.mean(filled),
    }


def main() -> None:
    torch.set_num_threads(1)
    checks = {name: named_check(name, _measure, *args) for name, args in LAYOUTS.items()}
    report = run_checks(list(checks.values()), 4, timeout=1800)
    rows = {name: report.assert_passed(check) for name, check in checks.items()}
    planned = plan(load_recipe("tiny", [*COMMON, *PP2]))
    base = rows["DP 4"]
    print(f"{'layout':<14}{'step s':>9}{'ratio':>8}{'peak MiB (max rank)':>22}{'ratio':>8}"
          f"{'P2P MiB/step/rank':>20}{'idle share':>12}{'row fill':>10}")  # fmt: skip
    for name, values in rows.items():
        step = statistics.median(v["step"] for v in values)
        rss = max(v["rss"] for v in values)
        p2p = max(v["p2p"] for v in values)
        idle = statistics.mean(v["idle"] for v in values)
        fill = statistics.mean(v["fill"] for v in values)
        print(
            f"{name:<14}{step:9.3f}{step / statistics.median(v['step'] for v in base):8.2f}"
            f"{rss / MIB:22.1f}{rss / max(v['rss'] for v in base):8.2f}{p2p / MIB:20.2f}"
            f"{idle:12.1%}{fill:10.0%}"
        )
    pp, padded = (
        statistics.median(v["step"] for v in rows[n]) for n in ("PP 2 x DP 2", "PP padded")
    )
    print(f"PP 2 x DP 2 without computing its padding: {pp / padded:.2f}x the padded step time")
    print(
        f"planner (PP 2 x DP 2): bubble {planned.bubble:.1%}, P2P "
        f"{planned.communication['pp_p2p'] / MIB:.2f} MiB/step (rank {max(planned.ranks)})"
    )


if __name__ == "__main__":
    main()
