"""What rank 0 prints while a run trains: what runs (its first lines), one line per step (or one
progress bar on a terminal) and the closing summary. The other ranks print nothing."""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import torch

from qwen35_trainer.demo.dataset import demo_dir
from qwen35_trainer.model.config import build_config
from qwen35_trainer.model.fp8.hold import fp8_summary
from qwen35_trainer.model.kernels import Kernels
from qwen35_trainer.model.lora.adapters import is_adapter
from qwen35_trainer.model.pipeline.build import stage_layers
from qwen35_trainer.model.whole import whole_parameters
from qwen35_trainer.recipe import Recipe
from qwen35_trainer.recipe.dimensions import product
from qwen35_trainer.recipe.hub import HUB_KEYS
from qwen35_trainer.supervise.metrics import StepLog

__all__ = ["Console", "input_lines", "parameter_lines", "quiet_cpu_notices", "what_runs"]


def what_runs(
    recipe: Recipe,
    world: int,
    device: torch.device,
    kernels: Kernels,
    model: torch.nn.Module | None = None,
) -> list[str]:
    """The run's first lines: its layout (with sequence parallelism, async TP and the FSDP
    backend), precision and compilation, the kernel each layer kind runs (``kernels``), the
    parameters that train and, with LoRA, which modules carry adapters, the FP8 base's modules
    and bytes (``model``, the whole model however it is split), the MTP head (when it has one),
    where the model and data were read from (:func:`input_lines`), data and run folder."""
    p, training, data = recipe.parallel, recipe.train, recipe.data
    backend = "nccl" if device.type == "cuda" else "gloo"
    sharding = "FSDP2" if p.fsdp_backend == "fsdp2" else "megatron-fsdp"
    if recipe.model.lora is not None and world == 1:  # see qwen35_trainer.parallel.apply
        sharding = "unsharded (one LoRA process: no FSDP copies of the base)"
    tp_extras = ""
    if p.tp > 1:
        tp_extras = f"; sequence parallel {'on' if p.sp else 'off'}"
        tp_extras += f", async TP {'on' if p.async_tp else 'off'}"
    compiled = "off"
    if training.compile or p.async_tp:
        compiled = "on (dynamic shapes)"
        if p.tp > 1:  # see qwen35_trainer.parallel.compile
            compiled = "on (the TP-split layers for static shapes: one graph per row length"
            compiled += ")" if data.pack_length else "; set data.pack_length for one graph)"
    lines = [
        f"layout: {product(p)}, ep {p.ep} "
        f"(ep_first {p.ep_first}) on {world} rank(s), {backend} on {device.type}; "
        f"{sharding}{tp_extras}",
        f"precision: {training.dtype}; activation checkpointing "
        f"{'on' if training.activation_checkpointing else 'off'}; deterministic "
        f"{'on' if training.deterministic else 'off'}; compiled blocks {compiled}",
        kernels.line(),
    ]
    if p.pp > 1:
        split = stage_layers(recipe, build_config(recipe.model))
        layers = ", ".join(f"{r.start}-{r.stop - 1}" for r in split)
        lines.insert(
            1,
            f"pipeline: pp {p.pp} x {p.pp_virtual_stages} stage(s) per rank, "
            f"{p.pp_schedule} over {training.grad_accum_steps} micro-batches; decoder layers "
            f"per stage {layers} (the first with the vision tower and embeddings, the last with "
            "the head, MTP and loss)",
        )
    weights = _weights_line(recipe)
    if weights:
        lines.append(weights)
    if model is not None:
        lines += parameter_lines(recipe, model)
    if recipe.model.mtp_depth:
        lines.append(
            f"multi-token prediction: {recipe.model.mtp_depth} layer(s) (mtp.*), loss weight "
            f"{training.mtp_loss_weight:g}, exported with the model"
        )
    lines += input_lines(recipe)
    if data.dataset:
        source = data.from_hub.get("path") or data.path or data.source
        processor = data.from_hub.get("processor") or data.processor
        if data.processor == recipe.model.path:
            processor = f"model.path's processor ({recipe.model.from_hub.get('path', processor)})"
        lines.append(f"data: {source} through {processor}, packed to {data.pack_length}")
    else:
        lines.append("data: the synthetic stream (no data.path)")
    lines.append(f"run folder: {training.output_dir or '(none)'}")
    return lines


def input_lines(recipe: Recipe) -> list[str]:
    """Where each input was read from: ``KEY: local PATH``, or ``KEY: Hub KIND ID@REVISION,
    snapshot PATH`` (the folder of its commit in the Hub cache; :mod:`qwen35_trainer.recipe.
    hub`)."""
    lines = []
    for section, key, _, kind in HUB_KEYS:
        values = getattr(recipe, section)
        path, hub = getattr(values, key), values.from_hub.get(key)
        if not path or (key == "processor" and path == recipe.model.path):
            continue
        said = "built-in" if Path(path).is_relative_to(demo_dir()) else "local"
        said = f"Hub {kind} {hub}, snapshot {path}" if hub else f"{said} {path}"
        lines.append(f"{section}.{key}: {said}")
    return lines


def parameter_lines(recipe: Recipe, model: torch.nn.Module) -> list[str]:
    """How many parameters train, of how many; with LoRA the modules carrying adapters and
    those trained in full; with an FP8 base its modules by kind and bytes. Counted over the
    whole model (every pipeline stage's), from full shapes."""
    whole = whole_parameters(model)
    total = sum(math.prod(p.param.shape) for p in whole)
    trained = sum(math.prod(p.param.shape) for p in whole if p.param.requires_grad)
    line = f"parameters: {trained:,} trained of {total:,}"
    if recipe.model.lora is not None:
        adapted = sorted(
            {p.name.rsplit(".", 1)[0] for p in whole if is_adapter(p.name)},
            key=lambda n: [int(x) if x.isdigit() else x for x in n.split(".")],
        )
        kinds = sorted({n.rsplit(".", 1)[-1] for n in adapted})
        full = list(getattr(model, "lora_trained", ())) or "none"
        line += (
            f"; LoRA adapters on {len(adapted)} modules ({', '.join(kinds)}); trained in full: "
            f"{full}"
        )
    lines = [line]
    if recipe.model.fp8_base:
        lines.append(fp8_summary(whole))
    return lines


def _weights_line(recipe: Recipe) -> str | None:
    """What the weights are held in when it is not simply the training dtype: a LoRA run's
    frozen base (in FP8: as the checkpoint stores it or quantized on load), or an FP8
    checkpoint dequantized for full fine-tuning."""
    model, dtype = recipe.model, recipe.train.dtype
    if model.fp8_base:
        source = "as the checkpoint stores it" if model.quantization else "quantized on load"
        return (
            f"frozen base: FP8 e4m3 in blocks of {list(model.block)} ({source}), computed as "
            f"the kernels line says (the block-scaled FP8 GEMM, or dequantized to {dtype} per "
            "projection); the LoRA adapters train in float32"
        )
    if model.lora is not None:
        return f"frozen base: {dtype}; the LoRA adapters train in float32"
    if model.quantization is not None:
        return (
            f"weights: the FP8 checkpoint dequantized into the float32 master weights (full "
            f"fine-tuning; blocks of {list(model.block)})"
        )
    return None


def quiet_cpu_notices() -> None:
    """Drop torch's "No CUDA runtime is found, using CUDA_HOME=..." notice on a machine without
    a GPU: Inductor's C++ builder imports ``torch.utils.cpp_extension``, which says it once per
    process whenever a CUDA toolkit is installed — on CPU it changes nothing."""
    notices = logging.getLogger("torch.utils.cpp_extension")
    if not torch.cuda.is_available() and _no_cuda_home_notice not in notices.filters:
        notices.addFilter(_no_cuda_home_notice)


def _no_cuda_home_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("No CUDA runtime is found")


class Console:
    """Rank 0's step lines (every ``log_every`` steps and the last) or progress bar."""

    def __init__(self, steps: int, log_every: int, printing: bool) -> None:
        self.steps, self.log_every, self.printing = steps, log_every, printing
        self.first: tuple[int, float] | None = None
        self.held_out: dict[str, str] = {}  # the newest evaluation, as the bar shows it
        self.bar = None
        if printing and sys.stdout.isatty():  # a terminal: one progress bar instead of lines
            from tqdm import tqdm

            self.bar = tqdm(total=steps, unit="step", dynamic_ncols=True)

    def step(self, log: StepLog) -> None:
        self.first = self.first or (log.step, time.perf_counter())
        if self.bar is not None:
            self.bar.n = log.step
            self.bar.set_postfix(self.postfix(log))
        elif self.printing and (log.step % self.log_every == 0 or log.step == self.steps):
            print(self.line(log), flush=True)

    def postfix(self, log: StepLog) -> dict[str, str]:
        """The bar's fields: loss, learning rate, tokens/s and, from the first evaluation on,
        the newest held-out loss and accuracy (``eval``, ``accuracy``, ``mtp_accuracy`` with
        the MTP head, as the step line names them). They stay shown until the next evaluation:
        the bar is redrawn every step, and an evaluating step is one of ``train.eval_every``."""
        if log.eval_loss is not None:
            self.held_out = {"eval": f"{log.eval_loss:.4f}", "accuracy": f"{log.eval_accuracy:.3f}"}
            if log.eval_mtp_accuracy is not None:
                self.held_out["mtp_accuracy"] = f"{log.eval_mtp_accuracy:.3f}"
        rate = log.tokens / log.seconds if log.seconds > 0 else 0.0
        shown = {"loss": f"{log.loss:.4f}", "lr": f"{log.lr:.2g}", "tok_s": f"{rate:.0f}"}
        return shown | self.held_out

    def close(self, logs: list[StepLog], output_dir: str | None) -> None:
        """The bar closed and the summary line."""
        if self.bar is not None:
            self.bar.close()
        if not self.printing:
            return
        if logs:
            pace = ""
            if len(logs) > 1:  # the first step warms up (allocations, compiles, prewarms)
                seconds = sum(log.seconds for log in logs[1:])
                tokens = sum(log.tokens for log in logs[1:])
                pace = f", {tokens / seconds:.0f} tok/s after the first step" if seconds else ""
            print(
                f"done: steps {logs[0].step}..{logs[-1].step} of {self.steps}, "
                f"loss {logs[0].loss:.4f} -> {logs[-1].loss:.4f}{pace}; run folder {output_dir}"
            )
        else:
            print(f"done: nothing to run, the newest checkpoint already has {self.steps} steps")

    def eta(self, log: StepLog) -> str:
        """Remaining time at the pace since the first reported step (which includes the warmup
        of the first step: compiles, allocations); "--" until there is a pace."""
        if self.first is None or log.step == self.first[0]:
            return "--"
        elapsed = time.perf_counter() - self.first[1]
        left = elapsed / (log.step - self.first[0]) * (self.steps - log.step)
        return f"{int(left // 60)}:{int(left % 60):02d}"

    def line(self, log: StepLog) -> str:
        steps = self.steps
        rate = log.tokens / log.seconds if log.seconds > 0 else float("nan")
        warm = " (warm-up)" if self.first is not None and log.step == self.first[0] else ""
        line = (
            f"step {log.step:>{len(str(steps))}}/{steps}  loss {log.loss:.4f}  ce {log.ce:.4f}  "
            f"aux {log.aux:.4f}  grad_norm {log.grad_norm:.3f}  lr {log.lr:.3g}  "
            f"tokens {log.tokens}  {rate:.0f} tok/s{warm}  {log.seconds * 1000:.0f} ms  "
            f"eta {self.eta(log)}"
        )
        if log.mtp_loss is not None:
            line += "  mtp_loss " + "/".join(f"{v:.4f}" for v in log.mtp_loss)
        if log.fill is not None:
            line += f"  fill {log.fill:.2f}"
        if log.eval_loss is not None:
            line += f"  eval {log.eval_loss:.4f}  accuracy {log.eval_accuracy:.3f}"
        if log.eval_mtp_accuracy is not None:
            line += f"  mtp_accuracy {log.eval_mtp_accuracy:.3f}"
        return line
