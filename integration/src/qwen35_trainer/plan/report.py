"""The plan as the table ``qwen35-train plan`` prints: the counted tensors per rank, then each
term of what the GPU holds beyond them (:mod:`qwen35_trainer.plan.headroom`), the traffic of one
step, the step's time on a GPU (:mod:`qwen35_trainer.plan.timing`), and the verdict against the
GPU's memory."""

from __future__ import annotations

from qwen35_trainer.plan.planner import GIB, Plan
from qwen35_trainer.plan.timing import StepTime

__all__ = ["format_memory_check", "format_plan", "format_time"]


def format_time(t: StepTime) -> list[str]:
    """The step-time lines: the GPU, the bottleneck's compute, each kind's exposed
    communication, the pipeline's fill and drain, the optimizer, then the totals."""
    g = t.gpu
    head = (
        f"step time on {g.name} ({g.bf16_tflops:g} TFLOP/s bf16, HBM {g.hbm_tbps:g} TB/s, "
        f"NVLink {g.nvlink_gbps:g} / InfiniBand {g.ib_gbps:g} GB/s per GPU one way; "
        "--gpu, --gpu-set, --efficiency to change)\n"
        "  its kernels at their published rates (plan/kernel_rates.py); launch gaps and elementwise "
        "work between them not counted (--measure on the GPU counts them)"
    )
    if t.profile is not None:
        rates = ", ".join(f"{c} {r / 1e9:.1f}" for c, r in t.profile.flops_per_s.items())
        head = (
            f"step time on the measured {t.profile.device}, torch {t.profile.torch} "
            f"(GFLOP/s: {rates}; {t.profile.call_s * 1e6:.1f} us per op call)"
        )
    lines = [
        head,
        f"  {'compute (bottleneck rank)':<31}{t.compute:10.3f} s",
        "  exposed communication",
        *(f"    {kind:<29}{s:10.3f} s" for kind, s in t.exposed.items()),
        f"  {'pipeline fill and drain':<31}{t.pipeline_idle:10.3f} s",
        f"  {'optimizer step':<31}{t.optimizer:10.3f} s",
        f"  {'step':<31}{t.seconds:10.3f} s",
        f"  {'tokens/s/GPU':<31}{t.tokens_per_gpu:10,.0f}",
        f"  {'model TFLOP/s/GPU':<31}{t.tflops_per_gpu:10.1f}   (MFU {t.mfu:.1%})",
    ]
    if t.profile is not None:  # a measured machine: no datasheet peak to compare with
        lines[-1] = f"  {'model GFLOP/s/rank':<31}{t.tflops_per_gpu * 1e3:10.1f}"
    return lines


def format_memory_check(profile) -> list[str]:
    """The measured profile's step of one process (:attr:`.profile.Profile.memory`) against
    the planner's count for it, and on a GPU the allocator's measured reserve."""
    m = profile.memory
    lines = [
        f"memory of one process's step of {profile.model}, measured on {profile.device}",
        f"  {'tensors at the peak':<27}{m['allocated'] / GIB:8.2f}   (of which persistent "
        f"{m['persistent'] / GIB:.2f})",
        f"  {'counted by the planner':<27}{m['counted'] / GIB:8.2f}   "
        f"({m['counted'] / m['allocated']:.2f}x the measured; persistent "
        f"{m['counted_persistent'] / GIB:.2f})",
    ]
    if profile.fragmentation is not None:
        lines.append(
            f"  {'allocator reserved':<27}{m['reserved'] / GIB:8.2f}   (fragmentation "
            f"{profile.fragmentation:.2f} of the step's transient tensors: the reserve above)"
        )
    return lines


def format_plan(p: Plan, timing: StepTime | None = None) -> str:
    """The plan as the table the command prints (``timing``: its step on a GPU)."""
    layout = " x ".join(f"{k} {v}" for k, v in p.layout.items() if v > 1) or "one rank"
    lines = [
        f"plan: {p.recipe_name} on {p.world} ranks ({layout})",
        f"total parameters            {p.total_parameters / 1e9:10.2f} B",
        *(
            [f"  of which the MTP head    {p.mtp_parameters / 1e9:10.2f} B (model.mtp_layers)"]
            if p.mtp_parameters
            else []
        ),
        f"active parameters per token {p.active_parameters / 1e9:10.2f} B",
        *([p.fp8] if p.fp8 else []),
        *([p.images] if p.images else []),
        "",
        "GiB per GPU          " + "".join(f"{'rank ' + str(r):>12}" for r in p.ranks),
    ]
    fields = list(next(iter(p.ranks.values())).__dataclass_fields__)
    for field in [*fields, "peak"]:
        values = "".join(f"{getattr(m, field) / GIB:12.2f}" for m in p.ranks.values())
        lines.append(f"  {'tensors counted' if field == 'peak' else field:<19}{values}")
    predicted = "".join(f"{p.rank_peak(r) / GIB:12.2f}" for r in p.ranks)
    lines.append(f"  {'predicted peak':<19}{predicted}")
    lines += [
        "",
        f"beyond the counted tensors of rank {p.worst_rank}, the largest predicted peak "
        "(--headroom NAME=VALUE to change)",
    ]
    lines += [f"  {term:<27}{n / GIB:8.2f}" for term, n in p.headroom_terms.items()]
    if timing is not None and timing.profile is not None:
        lines += ["", *format_memory_check(timing.profile)]
    lines += ["", "communication per step (GiB sent per rank)"]
    lines += [f"  {kind:<19}{n / GIB:12.2f}" for kind, n in p.communication.items()]
    if p.bubble is not None:
        lines += ["", f"pipeline bubble {p.bubble:.1%} of each step (idle on every rank)"]
    if timing is not None:
        lines += ["", *format_time(timing)]
    verdict = "fits" if p.fits else "does NOT fit"
    lines += [
        "",
        f"predicted peak {p.peak_gib:.2f} GiB per GPU (rank {p.worst_rank}: "
        f"{p.counted_gib:.2f} counted + "
        f"{p.peak_gib - p.counted_gib:.2f} headroom): {verdict} in "
        f"{p.gpu_memory_gib:g} GiB",
    ]
    return "\n".join(lines)
