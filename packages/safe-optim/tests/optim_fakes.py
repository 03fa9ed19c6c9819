"""CPU stand-ins for a backend that, like TransformerEngine's fused Adam, cannot take empty
tensors: its multi-tensor kernel reads the first element of every tensor and the first tensor
of every group. The math is torch's AdamW (for-loop path), so results compare with torch AdamW.
"""

from __future__ import annotations

import torch

from safe_optim import declare_no_empty_tensors, local_numel

EMPTY_TENSOR_ERROR = "fused kernel got an empty tensor"
EMPTY_GROUP_ERROR = "fused kernel got an empty param group"


class RawEmptyIntolerantAdamW(torch.optim.AdamW):
    """AdamW that fails on an empty (local) tensor or group; NOT declared, so not filtered."""

    def __init__(self, params, **kwargs):
        super().__init__(params, foreach=False, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        for i, group in enumerate(self.param_groups):
            if not group["params"]:
                raise RuntimeError(f"{EMPTY_GROUP_ERROR} (group {i})")
            for p in group["params"]:
                if p.grad is not None and local_numel(p) == 0:
                    raise RuntimeError(f"{EMPTY_TENSOR_ERROR} (group {i}, shape {tuple(p.shape)})")
        return super().step(closure)


@declare_no_empty_tensors
class EmptyIntolerantAdamW(RawEmptyIntolerantAdamW):
    """The same backend, declared: ``build_optimizer`` filters for it."""
