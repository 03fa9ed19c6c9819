"""The assembled trainer on GPUs (``nox -s gpu`` on a lent device; skipped without CUDA): the
kernel report names the fast kernels the ``gpu`` extra brings, LoRA trains on CUDA with the
experts' adapters on the torch grouped path (and on an FP8 base: the dequantize path, whose
memory the planner prices as one decode's peak), async TP (2 GPUs: TP 2 with
sequence parallelism, compiled blocks) fuses its collectives into the matmuls and trains the same
losses as async TP off, and megatron-fsdp (2 GPUs: real CUDA streams and NCCL, which the CPU
parity tests stand in for) trains the same step as FSDP2, and PP 2 (its P2P over NCCL) trains as
one GPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import SYNTHETIC, tiny

from qwen35_trainer.model.kernels import resolve_kernels
from qwen35_trainer.supervise.run_folder import step_records

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def test_the_kernel_report_on_cuda_names_the_fast_kernels():
    """The gpu extra (wheels only): torch's varlen_attn, fla, torch's grouped mm and fused AdamW;
    flash-attn and TransformerEngine where their opt-in extras are installed."""
    import importlib.util

    te = importlib.util.find_spec("transformer_engine") is not None
    flash = importlib.util.find_spec("flash_attn") is not None
    chosen = resolve_kernels(tiny("train.optimizer=auto", "train.dtype=bfloat16"), "cuda")
    assert chosen.record() == {
        "attention": "flash" if flash else "torch_varlen",
        "gated delta rule": "fla",
        "experts": "te" if te else "torch",
        "optimizer": "te_fused_adam" if te else "adamw",
    }, chosen.line()
    assert chosen.fallbacks == ()


def test_lora_trains_on_cuda_with_the_experts_on_the_torch_grouped_path():
    """LoRA in bf16 on one GPU: the experts' adapters run in the torch grouped path (the report
    says so, no fallback warning), only adapters move, and the first loss equals the base's."""
    lora = ("model.lora.rank=8", "model.lora.expert_rank=16", "train.dtype=bfloat16")
    recipe = tiny("train.optimizer=auto", "train.steps=2", *lora)
    chosen = resolve_kernels(recipe, "cuda")
    assert chosen.record()["experts"] == "torch" and chosen.fallbacks == (), chosen.line()
    from qwen35_trainer import train

    base = train(tiny("train.optimizer=auto", "train.steps=1", "train.dtype=bfloat16"))
    adapted = train(recipe)
    assert adapted.logs[0].loss == base.logs[0].loss
    assert math.isfinite(adapted.logs[-1].loss)
    assert all(
        p.requires_grad == (".lora" in n) for n, p in adapted.objective.model.named_parameters()
    )


def test_lora_on_an_fp8_base_trains_on_cuda_and_the_report_says_dequantize():
    """LoRA in bf16 on one GPU with the base quantized on load to FP8: the kernel report names
    the dequantize path (no FP8 GEMM path is built) without a fallback warning, the first loss
    is the bf16 base's to the quantization's error, only the adapters train."""
    lora = ("model.lora.rank=8", "train.dtype=bfloat16", "train.steps=2")
    recipe = tiny(*lora, "model.base_dtype=fp8", "model.fp8_block=[16, 16]")
    chosen = resolve_kernels(recipe, "cuda")
    assert chosen.record()["frozen base"] == "dequantize" and chosen.fallbacks == ()
    assert "no FP8 GEMM path" in chosen.line()
    from qwen35_trainer import train

    base = train(tiny(*lora, "train.steps=1"))
    adapted = train(recipe)
    assert abs(adapted.logs[0].loss - base.logs[0].loss) <= 0.02 * base.logs[0].loss
    assert math.isfinite(adapted.logs[-1].loss)
    model = adapted.objective.model
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    assert all(p.requires_grad == (".lora" in n) for n, p in model.named_parameters())


def test_the_planned_dequantization_bytes_are_one_decodes_peak_on_cuda():
    """``plan``'s ``dequantized`` line (a weight in bf16, its decode tables, one slice's int32
    indices) against the CUDA allocator's peak over one decode of experts' ``gate_up_proj``
    [16, 1024, 2048] in 128 x 128 blocks (two slices of CHUNK_ELEMENTS): equal within 2 MiB
    (the decode's few small index tensors)."""
    from torch import nn

    from moe_parallel import BlockFormat, dequantize, quantize
    from qwen35_trainer.plan.memory import _dequantized

    form = BlockFormat((128, 128), 2)
    data, scale = quantize(torch.randn(16, 1024, 2048, device="cuda"), form)
    holder = nn.Module()
    holder.register_parameter("gate_up_proj", nn.Parameter(data, requires_grad=False))
    holder.register_parameter("gate_up_proj_scale_inv", nn.Parameter(scale, requires_grad=False))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dequantize(data, scale, form, dtype=torch.bfloat16)
    peak = torch.cuda.max_memory_allocated() - before
    assert abs(_dequantized(holder, 2) - peak) <= 2 << 20, (_dequantized(holder, 2), peak)


def _two_rank_run(out, *overrides: str) -> tuple[list[float], str]:
    sets = [
        "parallel.dp=1",
        "parallel.cp=1",
        "parallel.ep=1",
        "parallel.tp=2",
        "train.steps=3",
        "train.eval_every=0",
        "train.deterministic=false",
        f"train.output_dir={out}",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["-m", "qwen35_trainer.cli", "tiny"] + [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "TORCH_LOGS": "output_code"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return [r["loss"] for r in step_records(out / "metrics.jsonl")], done.stdout + done.stderr


@two_gpus
def test_async_tp_fuses_the_collectives_and_trains_as_async_tp_off(tmp_path):
    off, _ = _two_rank_run(tmp_path / "off", "train.compile=true")
    on, printed = _two_rank_run(tmp_path / "on", "parallel.async_tp=true")
    assert "sequence parallel on, async TP on" in printed
    # Inductor's generated code calls the fused collective-matmul ops
    assert "fused_all_gather_matmul" in printed, "no all-gather -> matmul fusion"
    assert "fused_matmul_reduce_scatter" in printed, "no matmul -> reduce-scatter fusion"
    assert on == pytest.approx(off, rel=1e-3)


@two_gpus
@pytest.mark.parametrize(("dtype", "rel"), [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_megatron_fsdp_trains_as_fsdp2(tmp_path, dtype, rel):
    """DP 2 on megatron-fsdp and on FSDP2, fp32 and bf16 (bf16 compute over fp32 weights on
    both): the same logged losses."""
    layout = ("parallel.tp=1", "parallel.dp=2", f"train.dtype={dtype}", "train.checkpoint_every=0")
    fsdp2, _ = _two_rank_run(tmp_path / "fsdp2", *layout)
    megatron, printed = _two_rank_run(
        tmp_path / "megatron", *layout, "parallel.fsdp_backend=megatron"
    )
    assert "megatron-fsdp" in printed
    assert megatron == pytest.approx(fsdp2, rel=rel)


@two_gpus
def test_pipeline_parallelism_over_nccl_trains_as_one_gpu(tmp_path):
    """PP 2 (1F1B, the stages' P2P over NCCL) and one GPU, the same rows and micro-batches:
    the same logged losses."""
    from qwen35_trainer import train

    rows = ("data.packing=true", "data.pack_length=256", "train.grad_accum_steps=2")
    pp = ("parallel.tp=1", "parallel.pp=2", *SYNTHETIC, *rows)
    staged, printed = _two_rank_run(tmp_path / "pp", *pp)
    assert "pipeline: pp 2" in printed
    one = train(tiny(*rows, "train.steps=3", "train.deterministic=false"))
    assert staged == pytest.approx([log.loss for log in one.logs], rel=1e-3)
