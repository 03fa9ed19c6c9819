"""Low-rank adapters for the routed experts, applied inside the grouped expert computation.

Expert ``e``'s projection ``W_e`` ([O, I]: ``gate_up_proj[e]`` [2I, H] or ``down_proj[e]``
[H, I]) becomes ``W_e + s · B_e A_e`` with ``A_e`` [r, I], ``B_e`` [O, r] and the scale ``s =
alpha / r`` (rsLoRA: ``alpha / sqrt(r)``). The adapters of all experts are stacked like the
experts — ``A`` [E, r, in], ``B`` [E, out, r] — and for the rows of expert ``e`` (already
grouped by expert, :mod:`moe_parallel.grouped`)::

    y = x W_e^T + s · ((drop(x) A_e^T) B_e^T)

two grouped GEMMs through the rank ``r``: the ``[E, out, in]`` delta is never formed. With
``B = 0`` (the start) the adapted expert IS the base expert, bit for bit (the low-rank term is
an exact zero added to the base product). Every adapter stays in the autograd graph, so an
expert that received no rows gets zero adapter gradients, never ``None``.

The adapters are parameters of the :class:`~moe_parallel.moe.Experts` module itself
(``lora_gate_up_A`` …), not of a submodule: whatever shards the experts shards them the same
way and gathers them when the experts run — expert parallelism on dim 0
(:func:`moe_parallel.apply_expert_parallel`: the rows that reach an expert's rank meet its
adapters there, so the adapters' gradients, like the experts', equal the one-process ones),
and an FSDP unit around the experts (a submodule would be a unit of its own, never run, so
never gathered).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from moe_parallel.moe import ADAPTERS, Experts

__all__ = ["ADAPTERS", "LoRASpec", "add_expert_lora", "reset_expert_lora"]


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """``rank`` r, ``alpha``, ``dropout`` (on the adapter's input, training only) and
    ``rslora`` (scale ``alpha / sqrt(r)`` instead of ``alpha / r``)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    rslora: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def reset_expert_lora(experts: nn.Module) -> None:
    """``A`` Kaiming-uniform (per expert, as for a Linear of fan-in ``in``: ``uniform(±1 /
    sqrt(in))``), ``B`` zero."""
    with torch.no_grad():
        for name in ADAPTERS:
            weight = getattr(experts, name)
            if name.endswith("_A"):
                bound = 1.0 / math.sqrt(weight.shape[-1])
                weight.uniform_(-bound, bound)
            else:
                weight.zero_()


def add_expert_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Give every :class:`~moe_parallel.moe.Experts` module of ``model`` adapters
    (:data:`ADAPTERS`: ``lora_gate_up_A`` [E, r, H], ``lora_gate_up_B`` [E, 2I, r],
    ``lora_down_A`` [E, r, I], ``lora_down_B`` [E, H, r]; :func:`reset_expert_lora`) and its
    ``lora_spec``, before expert parallelism; returns their module names. The experts' own
    weights are left as they are (freeze them with ``requires_grad_(False)`` to train the
    adapters only)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, Experts):
            continue
        if module.ep_group is not None:
            raise ValueError(f"{name}: add expert LoRA before apply_expert_parallel")
        if module.lora_spec is not None:
            raise ValueError(f"{name}: the experts already have LoRA adapters")
        experts, two_i, hidden = module.gate_up_proj.shape
        r, device = spec.rank, module.gate_up_proj.device
        shapes = (
            (experts, r, hidden),
            (experts, two_i, r),
            (experts, r, two_i // 2),
            (experts, hidden, r),
        )
        for attr, shape in zip(ADAPTERS, shapes, strict=True):
            module.register_parameter(attr, nn.Parameter(torch.empty(shape, device=device)))
        module.lora_spec = spec
        reset_expert_lora(module)
        found.append(name)
    if not found:
        raise ValueError(f"{type(model).__name__} has no moe_parallel Experts to adapt")
    return found
