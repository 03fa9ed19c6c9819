"""LoRA on the Qwen3.5 MoE-VLM (``model.lora``): adapters on the decoder's projections and on
the fused routed experts, everything else frozen.

A target projection (an ``nn.Linear`` named in ``model.lora.targets``, in the decoder's layers;
never the vision tower, nor the multi-token-prediction head, which transformers' model — what
PEFT adapters load onto — does not have: it stays frozen, its loss still training the
decoder's adapters) becomes a :class:`LoRALinear`: the same
module and weight, plus ``lora_A`` [r, in] and ``lora_B`` [out, r], computing ``W x + s · B A
drop(x)``. The routed experts get adapters applied inside the grouped expert computation
(:func:`moe_parallel.add_expert_lora`: ``experts.lora_{gate_up,down}_{A,B}``, stacked by
expert; never an ``[E, out, in]`` delta). ``B`` starts at zero, so the model starts as its base bit for bit;
``A`` is Kaiming-uniform. Both are name-seeded like every parameter
(:mod:`qwen35_trainer.model.weights.init`), so every layout starts from the same adapters, and they are
never read from the base checkpoint. Every other parameter is frozen (``requires_grad`` off):
no gradient, no optimizer state, and checkpoints hold the adapters only.

The merged weight of an adapted projection (:func:`merged`) is ``W + s · B A`` per expert; a
merged model computes the adapted one's function (up to rounding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe_parallel import LoRASpec, add_expert_lora
from moe_parallel.moe import Experts
from qwen35_trainer.model.fp8.hold import base_linear, dequantized

__all__ = ["LoRALinear", "add_lora", "is_adapter", "lora_spec", "merged", "store_frozen"]

# adapter parameters: LoRALinear's own, and the experts' (``experts.lora_*``)
_ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
_EXPERT_ADAPTERS = ".experts.lora_"
# where adapters go: the decoder's layers (the vision tower and the MTP head stay as they are)
_ADAPTED_PREFIXES = ("model.language_model.layers.",)


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` (canonical) is a LoRA adapter."""
    return name.endswith(_ADAPTER_SUFFIXES) or _EXPERT_ADAPTERS in name


class LoRALinear(nn.Linear):
    """``nn.Linear`` with an adapter: ``lora_A`` [r, in], ``lora_B`` [out, r], ``lora_scale``
    s and ``lora_dropout`` (the probability on the adapter's input, in training). The base
    weight may be FP8 (:func:`qwen35_trainer.model.fp8.hold.base_linear`); the adapters run in the
    input's dtype (fp32 masters under bf16 compute are cast here, as a mixed-precision
    all-gather would have)."""

    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = base_linear(self, x)
        x_in = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        return y + self.lora_scale * F.linear(F.linear(x_in, a), b)


def lora_spec(lora, *, experts: bool = False) -> LoRASpec:
    """The adapters' :class:`moe_parallel.LoRASpec` of the recipe's ``model.lora``
    (``experts``: the routed experts', of rank ``expert_rank``)."""
    rank = lora.experts_rank if experts else lora.rank
    return LoRASpec(rank, lora.alpha, lora.dropout, lora.rslora)


def _to_lora_linear(module: nn.Linear, spec: LoRASpec) -> None:
    device = module.weight.device
    module.__class__ = LoRALinear
    module.lora_A = nn.Parameter(torch.empty(spec.rank, module.in_features, device=device))
    module.lora_B = nn.Parameter(torch.zeros(module.out_features, spec.rank, device=device))
    module.lora_scale, module.lora_dropout = spec.scale, spec.dropout


def add_lora(model: nn.Module, lora) -> list[str]:
    """Adapt ``model``'s targets (the recipe's ``model.lora``) and freeze every other
    parameter, in place (before any parallelism); returns the adapted modules' names.
    ``ValueError`` naming a target that matches no module."""
    spec = lora_spec(lora)
    adapted, unmatched = [], []
    for target in lora.targets:
        if target == "experts":
            # the decoder's experts only: the MTP head stays frozen, as its projections do
            decoder = model.model.language_model
            expert_spec = lora_spec(lora, experts=True)
            found = add_expert_lora(decoder, expert_spec)
            adapted += [f"model.language_model.{n}" for n in found]
            continue
        found = [
            (name, module)
            for name, module in model.named_modules()
            if name.startswith(_ADAPTED_PREFIXES)
            and name.endswith(f".{target}")
            and isinstance(module, nn.Linear)
        ]
        if not found:
            unmatched.append(target)
        for name, module in found:
            _to_lora_linear(module, spec)
            adapted.append(name)
    if unmatched:
        raise ValueError(
            f"model.lora.targets {unmatched} match no projection of the model (its decoder "
            "layers hold q/k/v/o_proj on attention layers, in_proj_*/out_proj on Gated "
            "DeltaNet layers, gate/up/down_proj in the shared expert)"
        )
    trained = trained_modules(model, lora.train_modules)
    model.lora_trained = tuple(trained)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name) or name.startswith(tuple(f"{t}." for t in trained)))
    return adapted


def trained_modules(model: nn.Module, keys) -> list[str]:
    """The names of ``model``'s modules trained in full (``model.lora.train_modules``: a module
    whose name ends with a key, PEFT's ``modules_to_save`` rule, so its export loads the same
    modules), outermost only; ``ValueError`` naming a key that matches nothing or a module that
    holds an adapter."""
    found, unmatched = [], []
    for key in keys:
        names = [n for n, _ in model.named_modules() if n.endswith(key)]
        unmatched += [] if names else [key]
        found += names
    if unmatched:
        head = hasattr(model, "mtp")
        absent = (
            ""
            if head or "mtp" not in unmatched
            else (
                "; the model has no multi-token-prediction head to train (model.mtp_layers: 0, or "
                "a checkpoint without mtp.*): drop mtp from train_modules"
            )
        )
        raise ValueError(
            f"model.lora.train_modules {unmatched} match no module of the model (e.g. "
            "lm_head, model.language_model.embed_tokens or embed_tokens, mlp.gate for the "
            f"routers, norm, visual or visual.merger{', mtp' if head else ''}){absent}"
        )
    outer = sorted({n for n in found if not any(n.startswith(f"{o}.") for o in found)})
    adapted = []
    for name in outer:
        held = [p for p, _ in model.get_submodule(name).named_parameters() if "lora_" in p]
        if held:
            adapted.append(f"{name} holds the adapters {held[:2]}")
    if adapted:
        raise ValueError(
            "model.lora.train_modules must not hold LoRA projections (a module trains in full "
            "or through adapters): " + "; ".join(adapted)
        )
    return outer


def store_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep every frozen parameter in ``dtype`` (bf16 under bf16 mixed precision: it has no
    master copy to keep, no gradient and no optimizer state, and the compute casts it to bf16
    anyway, so the step is the same bit for bit); in place, before the model is sharded. A
    base held in FP8 (:mod:`qwen35_trainer.model.fp8.hold`) keeps its FP8 bytes and fp32 scales."""
    for name, param in model.named_parameters():
        if param.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"):
            continue
        if not param.requires_grad:
            param.data = param.data.to(dtype)


def merged(module: nn.Module, attr: str, full: Callable[[torch.Tensor], torch.Tensor]):
    """The merged value of ``module``'s weight ``attr`` — ``W + s · B A`` (per expert for the
    routed experts; ``W`` dequantized when it is held in FP8) — or ``None`` when it has no
    adapter; ``full`` gathers a (sharded) parameter whole."""

    def base(name: str) -> torch.Tensor:
        value = dequantized(module, name, full)
        return full(getattr(module, name)) if value is None else value

    if isinstance(module, LoRALinear) and attr == "weight":
        delta = full(module.lora_B) @ full(module.lora_A)
        return base("weight") + module.lora_scale * delta
    spec = module.lora_spec if isinstance(module, Experts) else None
    if spec is None or attr not in ("gate_up_proj", "down_proj"):
        return None
    part = "gate_up" if attr == "gate_up_proj" else "down"
    a, b = full(getattr(module, f"lora_{part}_A")), full(getattr(module, f"lora_{part}_B"))
    return base(attr) + spec.scale * torch.bmm(b, a)
