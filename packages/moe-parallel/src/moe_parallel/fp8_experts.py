"""Routed experts whose frozen weights are held in block-scaled FP8 (:mod:`moe_parallel.fp8`).

:func:`quantize_experts` turns every :class:`~moe_parallel.moe.Experts` module's
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] into float8_e4m3fn parameters with
their block scales beside them, ``gate_up_proj_scale_inv`` [E, 2 · ceil(I / bo), ceil(H / bi)]
(the gate rows and the up rows blocked separately: the per-expert ``gate_proj`` and
``up_proj`` tensors of Qwen's FP8 checkpoints, stacked) and ``down_proj_scale_inv``
[E, ceil(H / bo), ceil(I / bi)]. All four stay stacked by expert, so whatever shards the
experts (expert parallelism's ``Shard(0)``, an FSDP unit) shards the scales with their experts.
They are frozen (``requires_grad`` off): FP8 holds a base that trains through adapters
(:mod:`moe_parallel.lora`), never a weight with its own gradient. On the meta device only the
dtypes and shapes change (a trainer fills the values from a checkpoint); otherwise the current
weights are quantized (:func:`moe_parallel.fp8.quantize`).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_parallel.fp8 import BlockFormat, quantize
from moe_parallel.moe import Experts

__all__ = ["EXPERT_FP8", "quantize_experts"]

# weight → (its scale, the row parts blocked separately)
EXPERT_FP8 = {
    "gate_up_proj": ("gate_up_proj_scale_inv", 2),
    "down_proj": ("down_proj_scale_inv", 1),
}


def quantize_experts(model: nn.Module, block: tuple[int, int]) -> list[str]:
    """Hold every routed expert weight of ``model`` in FP8 with ``block`` scales (module
    docstring), in place, before expert parallelism; returns the experts' module names."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, Experts):
            continue
        if module.ep_group is not None:
            raise ValueError(f"{name}: quantize the experts before apply_expert_parallel")
        if module.fp8_block is not None:
            raise ValueError(f"{name}: the experts are already held in FP8")
        for attr, (scale_attr, parts) in EXPERT_FP8.items():
            weight = getattr(module, attr)
            form = BlockFormat(tuple(block), parts)
            if weight.is_meta:
                data = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device="meta")
                scale = torch.empty(form.scale_shape(tuple(weight.shape)), device="meta")
            else:
                data, scale = quantize(weight.detach(), form)
            module.register_parameter(attr, nn.Parameter(data, requires_grad=False))
            module.register_parameter(scale_attr, nn.Parameter(scale, requires_grad=False))
        module.fp8_block = tuple(block)
        found.append(name)
    if not found:
        raise ValueError(f"{type(model).__name__} has no moe_parallel Experts to quantize")
    return found
