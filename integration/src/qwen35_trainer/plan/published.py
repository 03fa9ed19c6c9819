"""The step-time model (:mod:`.timing`) against the field's published Qwen3.6-35B-A3B runs
(``qwen35-train plan --published``; the table of ``docs/scaling.md``).

Each run is written as this trainer's recipe (the ``qwen3_5_35b_a3b`` recipes: the same
architecture as Qwen3.6-35B-A3B, MTP layer included) with the published layout, batch, rows and
recompute, planned on a fake world (:func:`.planner.plan`) and timed on the run's GPU with the efficiencies
of its published kernel measurements (:mod:`.kernel_rates`): every row is a prediction, none is fitted.
What a source does not publish, and what our recipe cannot say, is stated in the run's
``assumed`` text, printed under the table, and :data:`DIFFERENCES` says what the prediction
leaves out that the published step pays, or the reverse.

Sources: Megatron-Bridge's model verification card
``examples/model_verification_cards/qwen3.6-35b-a3b/card.yaml`` (steps 41–50 / 91–100 averages;
the recipes in ``src/megatron/bridge/recipes/qwen_vl/h100/qwen35_vl.py``), NeMo Automodel's
Qwen3.6-35B-A3B recipes (``examples/vlm_finetune/qwen3_5_moe/qwen3_6_35b.yaml``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from qwen35_trainer.plan.hardware import hardware
from qwen35_trainer.plan.timing import StepTime, step_time
from qwen35_trainer.recipe import load_recipe

__all__ = ["DIFFERENCES", "RUNS", "PublishedRun", "predict", "published_table"]

# Megatron-Bridge's 16-H100 layout: PP 2 (one stage per node) x DP 8, EP 8 inside each stage,
# one 4,096-token row per micro-batch (MBS 1), the MedPix / DataComp images at 448 x 448
_PP2_EP8 = (
    "parallel.pp=2",
    "parallel.dp=8",
    "parallel.cp=1",
    "parallel.ep=8",
    "data.pack_length=4096",
    "data.image_grids=[[1, 28, 28]]",
    "train.eval_every=0",
)


def _micro(n: int) -> tuple[str, ...]:
    """``n`` micro-batches of one sample (one row) per data-parallel group and step."""
    return (f"train.grad_accum_steps={n}", f"data.samples_per_rank={n}")


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    gpu: str  # :data:`.hardware.GPUS` key
    layout: str  # as published
    recipe: str
    sets: tuple[str, ...]
    seconds: float  # published step time
    tokens_per_gpu: float
    tflops_per_gpu: float | None  # None: not published
    assumed: str


RUNS = (
    PublishedRun(
        "Megatron-Bridge pretrain",
        "card.yaml pretrain_performance.H100",
        "h100",
        "16 x H100, TP 1 PP 2 EP 8, MBS 1 GBS 512, 4K",
        "qwen3_5_35b_a3b",
        (
            *_PP2_EP8,
            *_micro(64),
            "parallel.pp_layers=[16, 24]",
            "train.activation_checkpointing=false",
        ),
        22.271,
        5885.264,
        135.610,
        "selective recompute (core attention, GDN output norm, MoE activation) planned as none; "
        "the MTP layer trained (its recipe does not say; the card's model FLOPs per token, 2.30e10, "
        "equal its SFT's, which trains it); "
        "the run's CUDA graphs (attention, router, dispatch preprocessing), HybridEP dispatch "
        "overlapped with the experts' weight gradients and bf16 Adam moments are not this "
        "trainer's (its step is predicted graph-free, dispatch exposed); DataComp images "
        "planned at the recipe's largest, 784 patches",
    ),
    PublishedRun(
        "Megatron-Bridge SFT",
        "card.yaml sft.H100",
        "h100",
        "16 x H100, TP 1 PP 2 EP 8, MBS 1 GBS 32, 4K",
        "qwen3_5_35b_a3b",
        (*_PP2_EP8, *_micro(4), "parallel.pp_layers=[17, 23]"),
        3.268,
        2506.625,
        57.690,
        "full recompute of every layer (our activation checkpointing), graph-free, fp32 Adam "
        "state, MTP 1; MedPix rows padded to 4,096 (one image of 448 x "
        "448, attention over the whole row)",
    ),
    PublishedRun(
        "Megatron-Bridge LoRA",
        "card.yaml peft.H100",
        "h100",
        "16 x H100, TP 1 PP 2 EP 8, MBS 1 GBS 32, 4K",
        "qwen3_5_35b_a3b_lora",
        (
            *_PP2_EP8,
            *_micro(4),
            "parallel.pp_layers=[17, 23]",
            "train.activation_checkpointing=false",
        ),
        1.714,
        4778.627,
        109.940,
        "no recompute; their adapters (rank 32 on the attention and MLP linears, experts "
        "included) and ours (rank 16) are not counted; the tower frozen (no backward); the "
        "run's CUDA graphs are not this trainer's",
    ),
    PublishedRun(
        "NeMo Automodel SFT",
        "issue 61 (its source not found among Automodel's stored docs and recipes)",
        "h200",
        "8 x H200, EP 8, FSDP2",
        "qwen3_5_35b_a3b",
        (
            "parallel.dp=8",
            "parallel.cp=1",
            "parallel.ep=8",
            "data.pack_length=4096",
            "data.image_grids=[[1, 28, 28]]",
            *_micro(8),
        ),
        16.6,
        2800.0,
        None,
        "sequence length, batch and images unpublished: rows of 4,096 (Automodel's benchmark "
        "length) with one 448 x 448 image; the published step and tokens/s/GPU imply 371,840 "
        "tokens per step, more than the qwen3_6_35b.yaml recipe's (GBS 16 of <= 2,048), so the "
        "step time is compared at that many tokens; activation checkpointing as the recipe; "
        "its frozen tower trains here",
    ),
)


# what separates every prediction from its published step (docs/scaling.md prints it)
DIFFERENCES = (
    "Every prediction is faster than its published step, because it prices only the kernels: "
    "each op class at its published kernel rate, the links, the pipeline's fill and drain, the "
    "optimizer's streaming. Nothing between the kernels is counted: launch gaps and per-op host "
    "time (an eager op costs at least ~3.6 us of Python and dispatch: H. He, *Making Deep "
    "Learning Go Brrrr*), elementwise work (norms, SwiGLU, RoPE, the router's softmax and "
    "top-k, dtype casts), expert load imbalance beyond the planned routing skew, and EP's "
    "dispatch waiting on its slowest rank. The published stacks pay these too: their steps run "
    "at 5.8-13.7 % of the H100's peak where their GEMMs alone reach 80 %. The gap is smallest "
    "in the row that is most arithmetic (pretraining: 64 micro-batches, no recompute) and "
    "largest where each micro-batch is small against the step's fixed work. What those stacks "
    "have and this trainer lacks (their CUDA graphs, HybridEP's dispatch overlapped with the "
    "experts' weight gradients, bf16 Adam moments) shortens their steps, not ours: this "
    "trainer's own step should sit at least as far above its prediction. A profile measured on "
    "the GPU (`plan --measure`) prices the calls and the elementwise work; `tools/gpu_checks.py` "
    "measures this gap on the first GPU it gets (`bench_time_model.py --recipes 35b-shaped`)."
)


def predict(run: PublishedRun, planner: Callable | None = None, efficiency=None) -> StepTime:
    """``run`` planned as our recipe (module docstring) and timed on its GPU."""
    from qwen35_trainer.plan.planner import plan

    recipe = load_recipe(run.recipe, list(run.sets))
    planned = (planner or plan)(recipe, name=run.name)
    return step_time(planned, hardware(run.gpu), efficiency)


def step_at_published_tokens(run: PublishedRun, t: StepTime) -> float:
    """The predicted time of the published step's tokens (its time × tokens/s/GPU × GPUs)."""
    return run.seconds * run.tokens_per_gpu / t.tokens_per_gpu


def _cell(predicted: float, published: float | None, digits: int) -> str:
    if published is None:
        return f"{predicted:,.{digits}f} / — "
    return f"{predicted:,.{digits}f} / {published:,.{digits}f} ({round(100 * (predicted / published - 1)):+d} %)"


def published_table(planner: Callable | None = None) -> str:
    """The markdown table (module docstring): per run, our prediction / the published figure
    (the difference), then each run's recipe and assumptions."""
    lines = [
        "| run | GPUs and layout | step s | tokens/s/GPU | TFLOP/s/GPU |",
        "|---|---|---|---|---|",
    ]
    notes = []
    for i, run in enumerate(RUNS, 1):
        t = predict(run, planner)
        lines.append(
            f"| {i}. {run.name} | {run.layout} | "
            f"{_cell(step_at_published_tokens(run, t), run.seconds, 2)} | "
            f"{_cell(t.tokens_per_gpu, run.tokens_per_gpu, 0)} | "
            f"{_cell(t.tflops_per_gpu, run.tflops_per_gpu, 1)} |"
        )
        sets = " ".join(f"--set '{s}'" for s in run.sets)
        notes.append(
            f"{i}. `qwen35-train plan {run.recipe} {sets} --gpu {run.gpu}` "
            f"({run.source}): {run.assumed}."
        )
    header = "Efficiencies: each GPU's published kernel measurements (`plan/kernel_rates.py`), no run fitted."
    return "\n".join([*lines, "", header, "", DIFFERENCES, "", *notes])
