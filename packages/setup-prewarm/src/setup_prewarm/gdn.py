"""Find gated-delta-rule (Gated DeltaNet) layers by structure and collect their kernel shapes.

fla's chunked gated-delta-rule kernels are Triton kernels autotuned per (key heads, value
heads, key dim, value dim, dtype, varlen or not); the first call with a new combination compiles
and benchmarks candidates, which can take minutes and allocates outside the caching allocator.
Knowing the distinct shapes lets the prewarm run each combination once.

What counts as a GDN layer (duck typing, no class names, so transformers' Qwen3.5 / Qwen3-Next
layers and home-grown ones all match): a module with its own parameters ``A_log`` and
``dt_bias`` (the decay parameters, one per value head) and either child modules ``in_proj_qkv``,
``in_proj_a`` and ``in_proj_b`` or any of the size attributes below. Mamba-2 mixers also have
``A_log``/``dt_bias`` but neither, so they do not match.

A matched layer must carry four int attributes — ``num_k_heads``, ``num_v_heads``,
``head_k_dim``, ``head_v_dim`` — giving the sizes its kernel call sees on this rank (a layer
whose heads are split by tensor parallelism holds the local head counts). They are checked
against the parameters: ``A_log`` and ``dt_bias`` hold ``f·num_v_heads`` elements and
``in_proj_qkv`` (when present) has ``f·(2·num_k_heads·head_k_dim + num_v_heads·head_v_dim)``
outputs, for one integer ``f ≥ 1`` (``f`` > 1 when the attributes are TP-local and the
parameters are global DTensors). The dtype is the dtype holding most of the layer's parameter
elements (its projections), i.e. the dtype of q/k/v in a forward without autocast.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
from torch import nn

__all__ = ["GDNShape", "find_gdn_shapes", "is_gdn_layer"]

_SIZE_ATTRS = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
_PROJ_CHILDREN = ("in_proj_qkv", "in_proj_a", "in_proj_b")


@dataclasses.dataclass(frozen=True)
class GDNShape:
    """One kernel configuration: q/k have ``num_k_heads`` heads of ``head_k_dim``, v has
    ``num_v_heads`` heads of ``head_v_dim``; tensors are ``dtype`` (the gate ``g`` is fp32)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    dtype: torch.dtype

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"qk {self.num_k_heads}x{self.head_k_dim} v {self.num_v_heads}x{self.head_v_dim} {dtype}"


def is_gdn_layer(module: nn.Module) -> bool:
    """True when ``module`` has the structure of a gated-delta-rule layer (module docstring)."""
    own = dict(module.named_parameters(recurse=False))
    if "A_log" not in own or "dt_bias" not in own:
        return False
    children = dict(module.named_children())
    has_projections = all(name in children for name in _PROJ_CHILDREN)
    return has_projections or any(hasattr(module, a) for a in _SIZE_ATTRS)


def _shape_of(name: str, module: nn.Module) -> GDNShape:
    missing = [a for a in _SIZE_ATTRS if not isinstance(getattr(module, a, None), int)]
    if missing:
        raise ValueError(
            f"{name or '<root>'} ({type(module).__name__}) looks like a gated-delta-rule layer "
            f"(A_log, dt_bias) but lacks int attributes {missing}; expected all of {list(_SIZE_ATTRS)}"
        )
    hk, hv, dk, dv = (int(getattr(module, a)) for a in _SIZE_ATTRS)
    if min(hk, hv, dk, dv) <= 0:
        raise ValueError(f"{name}: sizes must be positive, got heads {hk}/{hv}, dims {dk}/{dv}")
    n_decay = module.A_log.numel()
    if n_decay % hv or module.dt_bias.numel() != n_decay:
        raise ValueError(
            f"{name}: A_log has {n_decay} and dt_bias {module.dt_bias.numel()} elements; "
            f"expected equal multiples of num_v_heads={hv}"
        )
    factor = n_decay // hv
    qkv = getattr(module, "in_proj_qkv", None)
    weight = getattr(qkv, "weight", None)
    if weight is not None:
        want = factor * (2 * hk * dk + hv * dv)
        if weight.shape[0] != want:
            raise ValueError(
                f"{name}: in_proj_qkv has {weight.shape[0]} outputs; expected {factor}·(2·{hk}·{dk} "
                f"+ {hv}·{dv}) = {want} from its size attributes"
            )
    numel_by_dtype: Counter[torch.dtype] = Counter()
    for p in module.parameters():
        if p.is_floating_point():
            numel_by_dtype[p.dtype] += p.numel()
    dtype = numel_by_dtype.most_common(1)[0][0]
    return GDNShape(hk, hv, dk, dv, dtype)


def find_gdn_shapes(model: nn.Module) -> list[GDNShape]:
    """The distinct :class:`GDNShape` of the GDN layers in ``model``, in module order.

    Raises ``ValueError`` naming the module when a layer matches the structure but its size
    attributes are missing or disagree with its parameters; ``TypeError`` for a non-module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    shapes: dict[GDNShape, None] = {}
    for name, module in model.named_modules():
        if is_gdn_layer(module):
            shapes.setdefault(_shape_of(name, module))
    return list(shapes)
