"""A linear layer whose compiled graph is the shape Inductor's micro-pipeline TP pass matches.

The pass (``torch/_inductor/fx_passes/micro_pipeline_tp.py``) rewrites

    all_gather -> [split/cat] -> reshape -> aten.mm -> reshape          (column parallel)
    reshape -> aten.mm -> reshape -> [split/cat] -> reduce_scatter      (row parallel)

into ``symm_mem.fused_all_gather_matmul`` / ``symm_mem.fused_matmul_reduce_scatter``. It only
knows ``aten.mm`` (and ``_scaled_mm``): ``F.linear`` with a bias on a 3-D input lowers to
``aten.addmm``, which the pass does not match, and a bias added between the matmul and its
unflattening reshape breaks the ``mm -> reshape`` link it looks for. So, when compiling with the
pass enabled, :func:`tp_linear` emits ``reshape -> mm -> reshape`` and adds the bias after the
unflattening reshape (for a 2-D input, whose mm has no reshape after it, behind a unit
dim: Inductor re-fuses ``add(mm, bias)`` into ``addmm``); :class:`TPLinear` additionally moves the bias of a row-parallel layer after
the reduce-scatter (a replicated bias added to a Partial output would sit between the matmul and
the reduce-scatter).

Correctness: ``F.linear(x, W, b)[..., o] = sum_h x[..., h] W[o, h] + b[o]`` and flattening the
leading dims is a relabelling of rows, so ``mm(x.reshape(N, H), W.t()).view(*lead, O) + b`` is the
same function with the same gradients; only the floating-point rounding of the bias addition may
differ from a fused ``addmm`` (within fp32 round-off). Eagerly (and when the pass is off)
``F.linear`` itself runs, bit for bit. For a Partial output, ``reduce(y) + b`` equals
``reduce(y + b / world)`` — what DTensor would otherwise compute — up to round-off.

Limits: a DTensor input sharded on a leading dim (e.g. ``Shard(1)``, the sequence dim) cannot be
flattened by a view without a redistribution, so it takes the ``F.linear`` path (correct, not
fusable). Whether the pass is enabled is read when the function is traced: enable async TP before
compiling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Shard

__all__ = ["TPLinear", "tp_linear"]


def _micro_pipeline_tp_enabled() -> bool:
    from torch._inductor import config

    return bool(getattr(config, "_micro_pipeline_tp", False))


def _check_linear_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, value in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(value, torch.Tensor) and not (name == "bias" and value is None):
            raise TypeError(f"tp_linear: {name} must be a torch.Tensor, got {type(value).__name__}")
    if weight.ndim != 2:
        raise ValueError(
            f"tp_linear: weight must be 2-D [out, in], got shape {tuple(weight.shape)}"
        )
    if x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"tp_linear: x must be [..., in={weight.shape[1]}] for weight {tuple(weight.shape)}, "
            f"got shape {tuple(x.shape)}"
        )
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(
            f"tp_linear: bias must be 1-D [out={weight.shape[0]}], got shape {tuple(bias.shape)}"
        )


def _flattenable(x: torch.Tensor) -> bool:
    """A view can fold x's leading dims into one unless a DTensor shards one of them."""
    if not isinstance(x, DTensor):
        return True
    last = x.ndim - 1
    return not any(isinstance(p, Shard) and p.dim % x.ndim != last for p in x.placements)


def tp_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` shaped so that async TP can fuse it.

    Args:
        x: ``[..., in]`` input (plain tensor or DTensor).
        weight: ``[out, in]``.
        bias: ``[out]`` or ``None``.

    Returns:
        ``[..., out]``. Under ``torch.compile`` with ``torch._inductor.config._micro_pipeline_tp``
        set and a flattenable input, computed as ``mm(x.reshape(N, in), weight.t())`` reshaped
        back to ``[..., out]`` with the bias added afterwards; otherwise ``F.linear`` itself.
    """
    _check_linear_args(x, weight, bias)
    if not (torch.compiler.is_compiling() and _micro_pipeline_tp_enabled() and _flattenable(x)):
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x_NI = x.reshape(math.prod(lead), x.shape[-1])
    y = F.linear(x_NI, weight).view(*lead, weight.shape[0])
    if bias is None:
        return y
    if len(lead) == 1:
        # Inductor's post-grad patterns fold add(mm(a, b), bias) back into addmm, which the TP
        # pass does not match; a unit dim between the mm and the add keeps them apart.
        return (y.unsqueeze(0) + bias).squeeze(0)
    return y + bias


def _has_partial(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, Partial) for p in t.placements)


class TPLinear(nn.Linear):
    """``nn.Linear`` computed by :func:`tp_linear`; same parameters, same state dict.

    ``reduce_output_to``: for a row-parallel layer with a bias, the placements its output should
    have (e.g. ``(Shard(1),)`` under sequence parallel — the ``output_layouts`` of its
    ``RowwiseParallel``). When set and the matmul output is Partial, the layer reduces it to these
    placements itself (the reduce-scatter the pass fuses with the matmul) and adds the bias after.
    :func:`swap_tp_linears` sets it from the plan.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        reduce_output_to: Sequence[Placement] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.reduce_output_to = tuple(reduce_output_to) if reduce_output_to is not None else None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, reduce_output_to: Sequence[Placement] | None = None
    ) -> TPLinear:
        """A ``TPLinear`` holding ``linear``'s own parameter objects (no copy, no re-init)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            reduce_output_to=reduce_output_to,
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., in_features]`` → ``[..., out_features]``."""
        if self.bias is None or self.reduce_output_to is None:
            return tp_linear(x, self.weight, self.bias)
        y = tp_linear(x, self.weight)
        if _has_partial(y):
            y = y.redistribute(y.device_mesh, self.reduce_output_to)
        return y + self.bias

    def extra_repr(self) -> str:
        extra = (
            "" if self.reduce_output_to is None else f", reduce_output_to={self.reduce_output_to}"
        )
        return super().extra_repr() + extra
