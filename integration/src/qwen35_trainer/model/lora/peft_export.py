"""A LoRA run's adapters as the files PEFT and the inference servers load.

Two adapter layouts, both with the scale ``s`` (``alpha / r``, rsLoRA's ``alpha / sqrt(r)``)
folded into ``B`` and ``lora_alpha = r`` in ``adapter_config.json`` — and, where the experts'
rank differs, ``rank_pattern`` / ``alpha_pattern`` giving them ``lora_alpha = rank`` too — so
the scale is 1 everywhere: a loader that ignores the patterns (vLLM does) still computes the
trained function. Keys are PEFT's, ``base_model.model.{module}.lora_{A,B}.weight``:

- ``peft`` (PEFT >= 0.19.1's ``target_parameters`` layout for the fused experts, the layout
  vLLM reads Qwen3.5-MoE expert adapters in): ``target_parameters = ["experts.gate_up_proj",
  "experts.down_proj"]``; PEFT wraps a module's parameters in their registration order,
  ``gate_up_proj`` first, so its adapter sits under ``experts.base_layer.`` and
  ``down_proj``'s under ``experts.``; each ``lora_A`` is
  ``[E·r, in]`` (row ``e·r + k`` = our ``A[e, k]``) and each ``lora_B`` ``[out, r·E]``
  (column ``k·E + e`` = our ``B[e, :, k]``).
- ``per_expert`` (2-D adapters per expert, as servers read Qwen3-MoE's): ``experts.{e}.
  {gate,up,down}_proj.lora_{A,B}.weight``; ``gate_proj`` and ``up_proj`` share the expert's
  ``A`` (one input) and take the first / second half of its ``B``'s rows.

The dense projections' adapters are ``lora_A`` [r, in] and ``lora_B`` [out, r] in both. The
modules trained in full (``model.lora.train_modules``) are written whole as PEFT saves its
``modules_to_save`` — ``base_model.model.{module}.{parameter}``, the keys listed under
``modules_to_save`` — except the multi-token-prediction head's: transformers' model, which PEFT
wraps, has none (the merged export carries it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moe_parallel.moe import Experts
from qwen35_trainer.model.lora.adapters import LoRALinear
from qwen35_trainer.model.mtp import MTP_PREFIX
from qwen35_trainer.model.params import canonical_name
from qwen35_trainer.model.weights.saving import save_tensors
from qwen35_trainer.model.whole import held

__all__ = ["LORA_FORMATS", "adapter_config", "adapter_tensors", "write_adapter"]

LORA_FORMATS = ("peft", "per_expert", "merged")
PREFIX = "base_model.model."
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]  # PEFT's wrapping order


def _dense(name: str, module: LoRALinear, full: Callable) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{PREFIX}{name}.lora_A.weight", full(module.lora_A)
    yield f"{PREFIX}{name}.lora_B.weight", module.lora_scale * full(module.lora_B)


def _experts(name: str, module: Experts, full: Callable, per_expert: bool):
    s = module.lora_spec.scale
    gate_up_a, gate_up_b = full(module.lora_gate_up_A), s * full(module.lora_gate_up_B)
    down_a, down_b = full(module.lora_down_A), s * full(module.lora_down_B)
    experts, rank, _ = gate_up_a.shape
    if per_expert:
        half = gate_up_b.shape[1] // 2
        for e in range(experts):
            at = f"{PREFIX}{name}.{e}"
            yield f"{at}.gate_proj.lora_A.weight", gate_up_a[e]
            yield f"{at}.gate_proj.lora_B.weight", gate_up_b[e, :half]
            yield f"{at}.up_proj.lora_A.weight", gate_up_a[e]
            yield f"{at}.up_proj.lora_B.weight", gate_up_b[e, half:]
            yield f"{at}.down_proj.lora_A.weight", down_a[e]
            yield f"{at}.down_proj.lora_B.weight", down_b[e]
        return
    for at, a, b in ((f"{name}.base_layer", gate_up_a, gate_up_b), (name, down_a, down_b)):
        yield f"{PREFIX}{at}.lora_A.weight", a.reshape(experts * rank, a.shape[-1])
        yield f"{PREFIX}{at}.lora_B.weight", b.permute(1, 2, 0).reshape(b.shape[1], -1)


def adapter_tensors(model: nn.Module, full: Callable, *, per_expert: bool):
    """``(key, tensor)`` of every adapter of ``model`` in module order (module docstring), then
    of every module it trains in full (PEFT's ``modules_to_save``: ``{PREFIX}{module}.{param}``;
    not the MTP head's, which PEFT's model does not have); ``full`` gathers a (sharded)
    parameter whole — a collective: every rank calls this."""
    for path, module in model.named_modules():
        name = canonical_name(path)
        if isinstance(module, LoRALinear):
            yield from _dense(name, module, full)
        elif isinstance(module, Experts) and module.lora_spec is not None:
            yield from _experts(name, module, full, per_expert)
    for name in saved_modules(model):
        if not held(model, name):  # another pipeline stage's: its ranks gather it
            continue
        for param_name, param in model.get_submodule(name).named_parameters():
            yield f"{PREFIX}{name}.{canonical_name(param_name)}", full(param)


def saved_modules(model: nn.Module) -> list[str]:
    """The modules ``model`` trains in full that PEFT's model has (the MTP head's it has not)."""
    return [n for n in getattr(model, "lora_trained", ()) if not f"{n}.".startswith(MTP_PREFIX)]


def adapter_config(lora, *, per_expert: bool, base: str | None) -> dict:
    """``adapter_config.json`` for the recipe's ``model.lora`` (scales folded, module
    docstring; ``modules_to_save``: its ``train_modules`` but ``mtp``); ``base``: the base
    checkpoint (``base_model_name_or_path``)."""
    dense = [t for t in lora.targets if t != "experts"]
    experts = "experts" in lora.targets
    if experts and per_expert:
        dense = sorted({*dense, "gate_proj", "up_proj", "down_proj"})
    config = {
        "peft_type": "LORA",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.rank,
        "target_modules": sorted(dense),
        "target_parameters": EXPERT_PARAMETERS if experts and not per_expert else None,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": [m for m in lora.train_modules if m != "mtp"] or None,
        "task_type": None,
    }
    if experts and lora.experts_rank != lora.rank:
        # PEFT matches a pattern against the end of a module's name, for a target parameter
        # against "{module}.{parameter}"
        keys = [r"experts\.\d+\.(gate|up|down)_proj"] if per_expert else EXPERT_PARAMETERS
        config["rank_pattern"] = dict.fromkeys(keys, lora.experts_rank)
        config["alpha_pattern"] = dict.fromkeys(keys, lora.experts_rank)
    return config


def write_adapter(
    model: nn.Module,
    lora,
    out: Path,
    full: Callable,
    *,
    per_expert: bool,
    base: str | None,
    writer: bool,
    pipeline: bool = False,
) -> None:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` into ``out`` (only
    where ``writer``, rank 0; every rank gathers the adapters with ``full``). Under pipeline
    parallelism (``pipeline``) each rank gathers its stages' adapters and rank 0 collects every
    rank's (one ``gather_object``: the adapters are small)."""
    tensors = {
        key: value.detach().to("cpu", torch.float32, copy=True).contiguous()
        for key, value in adapter_tensors(model, full, per_expert=per_expert)
    }
    if pipeline:
        parts = [None] * dist.get_world_size() if writer else None
        dist.gather_object(tensors, parts, dst=0)
        tensors = {k: v for part in parts or () for k, v in part.items()}
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        save_tensors(tensors, out / "adapter_model.safetensors")
        config = adapter_config(lora, per_expert=per_expert, base=base)
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
