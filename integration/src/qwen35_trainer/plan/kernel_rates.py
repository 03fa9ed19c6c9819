"""Each op class's efficiency on each GPU (:mod:`.hardware`), from PUBLISHED measurements of the
kernels this trainer runs at comparable shapes: no trainer's step time is fitted
(``docs/scaling.md`` compares the predictions with the published runs instead).

An efficiency is achieved FLOP/s over the GPU's dense BF16 peak, with the FLOPs counted as
:mod:`qwen35_trainer.model.flops` counts them and executed as :mod:`.work` executes them (the
backward of a core twice its forward's FLOPs). Where a source counts FLOPs differently, the
conversion is below; where it publishes the forward only, the backward is what the source of
:data:`BACKWARD_TIME` says about the same kernel.

- ``matmul`` and ``head`` (cuBLAS BF16 GEMMs, ``torch.matmul``): the Maximum Achievable Matmul
  FLOPS table of S. Bekman's *Machine Learning Engineering* (``compute/accelerator/README.md``):
  H100 SXM 794.5 TFLOP/s (best shape 2048 x 2048 x 13312, its note: H200 the same), B200 1745.0
  (1792 x 16128 x 3072). Narrow shapes like the decoder's 2,048-wide projections are where
  those maxima were found; the ``lm_head`` GEMM is one of them, only wider.
- ``grouped`` (``torch._grouped_mm`` over the routed experts): VeOmni PR #460's fused MoE
  forward on an H100, hidden 2048, expert width 512, 512 experts top 10, 32,768 tokens: 180.67
  TFLOP/s, routing and permutation included (its FLOPs ``2·T·k·H·3I``, ours). No backward and
  no H200 or B200 figure is published: the H100's efficiency for all three.
- ``attention`` (FlashAttention-3, Shah et al. 2024, H100 SXM5 at 4K tokens): forward at head
  dim 256, causal, 612 TFLOP/s (Fig. 5); backward at head dim 128, the only one published, 542
  (Fig. 6); FA counts a backward as 2.5 forwards, so ``3 / (1/612 + 2.5/542)`` TFLOP/s of our
  three forward-equivalents. B200: FlashAttention-4's "up to 1613 TFLOP/s" forward, the
  backward at the H100's backward-to-forward rate.
- ``recurrence`` (fla's ``chunk_gated_delta_rule`` at Qwen3.5-35B's heads: 16 key and 32 value
  heads of 128): forward over one row of 4,096 tokens in 0.288 ms on an H100 and 0.333 ms on a
  B200 (FlashInfer PRs #3788 and #3001, their FLA baseline); our forward counts ``6·Hv·Dk·Dv``
  FLOPs per token (1.29e10 over the row); fla's own README (GB200, ``chunk_gdn``, 4 x 4,096
  tokens, 64 heads of 128) times forward and backward at 5.964 ms against a 1.581 ms forward.
- ``hbm`` (the optimizer's streaming): a softmax at 3.01 of the H100's 3.35 TB/s (QuACK's
  memory-bound blog, 2025-07-10); an RMSNorm at 6,516.67 GB/s of the B200's 8 TB/s (CUTLASS
  PR #2917). H200: the H100's fraction (none published).

What no efficiency here counts: kernel launch gaps and per-op host overhead, elementwise
(memory-bound) work between the kernels, expert load imbalance beyond the planner's routing
skew. A datasheet prediction is the step's kernels at their published rates: a measured
profile (``qwen35-train plan --measure`` on the GPU) adds what its calls and elementwise work
cost there.
"""

from __future__ import annotations

from qwen35_trainer.model.flops import PEAK_BF16_FLOPS

__all__ = ["BACKWARD_TIME", "GDN_ROW_FLOPS", "PUBLISHED", "published_efficiencies"]

# forward-and-backward time over forward time of fla's chunked gated delta rule (its README,
# GB200: 5.964 ms over 1.581 ms)
BACKWARD_TIME = {"recurrence": 5.964 / 1.581}
# FLOPs of one forward of the gated delta rule over the sources' row: 4,096 tokens x 6 x 32
# value heads x 128 x 128 (:func:`qwen35_trainer.model.flops.forward_flops`, ``gdn_core``)
GDN_ROW_FLOPS = 4096 * 6 * 32 * 128 * 128
# the published figures per GPU (module docstring): TFLOP/s, or milliseconds (``gdn_ms``),
# or the achieved fraction of the HBM datasheet figure
PUBLISHED = {
    "h100": {
        "gemm_tflops": 794.5,
        "grouped_tflops": 180.67,
        "attention_forward_tflops": 612.0,
        "attention_backward_tflops": 542.0,
        "gdn_ms": 0.288,
        "hbm": 3.01 / 3.35,
    },
    "b200": {
        "gemm_tflops": 1745.0,
        "attention_forward_tflops": 1613.0,
        "gdn_ms": 0.333,
        "hbm": 6516.67 / 8000,
    },
}
# what a GPU takes from another where nothing of its own is published (module docstring)
BORROWED = {"h200": "h100"}


def published_efficiencies(gpu: str, peak_tflops: float) -> dict[str, float]:
    """The efficiencies of ``gpu`` (a :data:`.hardware.GPUS` key) whose dense BF16 peak is
    ``peak_tflops`` (module docstring): the compute classes over that peak, and ``hbm``."""
    own = {**PUBLISHED[BORROWED.get(gpu, gpu)], **PUBLISHED.get(gpu, {})}
    h100 = PUBLISHED["h100"]
    # FLOP/s where a figure of its own is missing: the H100's efficiency on this GPU's peak
    h100_peak = PEAK_BF16_FLOPS["H100"] / 1e12
    grouped = own.get("grouped_tflops", h100["grouped_tflops"] / h100_peak * peak_tflops)
    forward = own["attention_forward_tflops"]
    backward = own.get(
        "attention_backward_tflops",
        forward * h100["attention_backward_tflops"] / h100["attention_forward_tflops"],
    )
    attention = 3 / (1 / forward + 2.5 / backward)
    gdn_forward = GDN_ROW_FLOPS / (own["gdn_ms"] * 1e-3) / 1e12
    recurrence = 3 * gdn_forward / BACKWARD_TIME["recurrence"]
    tflops = {
        "matmul": own["gemm_tflops"],
        "head": own["gemm_tflops"],
        "grouped": grouped,
        "attention": attention,
        "recurrence": recurrence,
    }
    return {**{k: v / peak_tflops for k, v in tflops.items()}, "hbm": own["hbm"]}
