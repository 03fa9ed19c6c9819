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

Expert parallelism shards the adapters with their experts (dim 0, :func:`moe_parallel.
apply_expert_parallel`): the rows that reach an expert's rank meet its adapters there, so the
adapters' gradients, like the experts', equal the one-process ones.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

__all__ = ["ExpertLoRA", "LoRASpec", "add_expert_lora"]


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


class ExpertLoRA(nn.Module):
    """The adapters of one :class:`~moe_parallel.moe.Experts` module: ``gate_up_A`` [E, r, H],
    ``gate_up_B`` [E, 2I, r], ``down_A`` [E, r, I], ``down_B`` [E, H, r]. ``A`` starts
    Kaiming-uniform (per expert, as for a Linear of fan-in ``in``), ``B`` at zero."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, spec: LoRASpec) -> None:
        super().__init__()
        self.spec = spec
        r = spec.rank
        self.gate_up_A = nn.Parameter(torch.empty(num_experts, r, hidden))
        self.gate_up_B = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, r))
        self.down_A = nn.Parameter(torch.empty(num_experts, r, intermediate))
        self.down_B = nn.Parameter(torch.zeros(num_experts, hidden, r))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for a in (self.gate_up_A, self.down_A):
                bound = 1.0 / math.sqrt(a.shape[-1])  # kaiming_uniform(a=sqrt(5)) of a Linear
                a.uniform_(-bound, bound)
            self.gate_up_B.zero_()
            self.down_B.zero_()

    def local(self) -> tuple[torch.Tensor, ...]:
        """This rank's ``(gate_up_A, gate_up_B, down_A, down_B)`` (the local shards under EP)."""
        weights = (self.gate_up_A, self.gate_up_B, self.down_A, self.down_B)
        return tuple(w.to_local() if hasattr(w, "to_local") else w for w in weights)


def add_expert_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Give every :class:`~moe_parallel.moe.Experts` module of ``model`` an
    :class:`ExpertLoRA` (``experts.lora``), before expert parallelism; returns their module
    names. The experts' own weights are left as they are (freeze them with
    ``requires_grad_(False)`` to train the adapters only)."""
    from moe_parallel.moe import Experts

    found = []
    for name, module in model.named_modules():
        if not isinstance(module, Experts):
            continue
        if module.ep_group is not None:
            raise ValueError(f"{name}: add expert LoRA before apply_expert_parallel")
        if module.lora is not None:
            raise ValueError(f"{name}: the experts already have LoRA adapters")
        num_experts, two_i, hidden = module.gate_up_proj.shape
        device = module.gate_up_proj.device
        with torch.device(device):
            module.lora = ExpertLoRA(num_experts, hidden, two_i // 2, spec)
        found.append(name)
    if not found:
        raise ValueError(f"{type(model).__name__} has no moe_parallel Experts to adapt")
    return found
