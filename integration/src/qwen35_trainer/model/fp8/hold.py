"""The frozen base in block-scaled FP8 (``model.base_dtype: fp8``, or LoRA on an FP8 checkpoint).

Which weights: those Qwen's FP8 releases convert — in every decoder layer and in the
multi-token-prediction head's layers, the attention's ``q/k/v/o_proj``, the Gated DeltaNet's
``in_proj_qkv``, ``in_proj_z`` and ``out_proj``, the shared expert's ``gate/up/down_proj`` and
the routed experts (:data:`CONVERTED`). Everything else stays in its dtype as in those releases:
embeddings, ``lm_head``, norms, the routers and ``shared_expert_gate``, the Gated DeltaNet's
``A_log``, ``conv1d``, ``dt_bias``, ``in_proj_a`` / ``in_proj_b``, the vision tower and the MTP
head's ``fc``.

How: :func:`hold_base_in_fp8` changes the meta model before it is parallelised. A converted
projection's ``weight`` becomes a float8_e4m3fn parameter with ``weight_scale_inv`` (fp32,
``[ceil(out / bo), ceil(in / bi)]``) beside it and ``fp8_form`` set; a projection without an
adapter becomes an :class:`FP8Linear`. The routed experts go through
:func:`moe_parallel.quantize_experts`. Every one of them is frozen. The values are filled per
shard afterwards (:mod:`qwen35_trainer.model.fp8.load`: the checkpoint's FP8 bytes and scales
as stored, or a bf16 checkpoint quantized on load).

Compute: :func:`base_linear` is the one linear of a (possibly FP8) projection;
:func:`moe_parallel.fp8_linear` dequantizes the weight in the activations' dtype for the call
and again in the backward, saving only the FP8 bytes, so the model never holds its base in bf16
(the routed experts do the same per layer, for this rank's experts only); on a GPU that runs
torch's block-scaled FP8 GEMM, a projection in 128 × 128 blocks goes through it instead
(:mod:`moe_parallel.fp8_gemm`; the kernel report says which). A module trained in
full (``model.lora.train_modules``, e.g. the MTP head) keeps its precision: an FP8 weight cannot
take an optimizer step.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_parallel import BlockFormat, FP8Weight, dequantize, fp8_linear, quantize_experts
from moe_parallel.fp8_experts import EXPERT_FP8
from moe_parallel.moe import Experts

logger = logging.getLogger("qwen35_trainer")

__all__ = [
    "CONVERTED",
    "FP8_LAYERS",
    "FP8Linear",
    "base_linear",
    "converted_form",
    "dequantized",
    "fp8_summary",
    "hold_base_in_fp8",
    "is_fp8",
]

# the projections held in FP8 (module name suffixes), in the layers of FP8_LAYERS
CONVERTED = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.out_proj",
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
)
FP8_LAYERS = ("model.language_model.layers.", "mtp.layers.")


def base_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module``'s own linear of ``x``: ``F.linear``, or with an FP8 weight the linear of its
    dequantized weight (module docstring)."""
    form = getattr(module, "fp8_form", None)
    if form is None:
        return F.linear(x, module.weight, module.bias)
    y = fp8_linear(x, FP8Weight(module.weight, module.weight_scale_inv, form))
    return y if module.bias is None else y + module.bias


class FP8Linear(nn.Linear):
    """A frozen projection whose ``weight`` is FP8 with ``weight_scale_inv`` beside it."""

    fp8_form: BlockFormat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return base_linear(self, x)


def is_fp8(param: torch.Tensor) -> bool:
    """Whether ``param`` holds FP8 bytes."""
    return param.dtype == torch.float8_e4m3fn


def _convert(module: nn.Linear, form: BlockFormat) -> None:
    shape = tuple(module.weight.shape)
    data = torch.empty(shape, dtype=torch.float8_e4m3fn, device="meta")
    scale = torch.empty(form.scale_shape(shape), device="meta")
    module.register_parameter("weight", nn.Parameter(data, requires_grad=False))
    module.register_parameter("weight_scale_inv", nn.Parameter(scale, requires_grad=False))
    module.fp8_form = form
    if type(module) is nn.Linear:
        module.__class__ = FP8Linear


def hold_base_in_fp8(
    model: nn.Module, block: tuple[int, int], stored: set[str] | None = None
) -> list[str]:
    """Hold ``model``'s frozen projections and routed experts in FP8 with ``block`` scales, on
    the meta device, after LoRA was added; returns the converted modules' names. Which ones:
    with ``stored`` (the runtime weights an FP8 checkpoint stores in float8,
    :func:`qwen35_trainer.model.weights.adapter.fp8_weights`) exactly those — a module the
    checkpoint keeps in bf16 stays bf16 —, else the release rule (module docstring). A module
    trained in full keeps its precision either way (a float8 weight of it is dequantized on
    load)."""
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("hold_base_in_fp8 changes the meta model, before it is materialised")
    form = BlockFormat(tuple(block))
    converted, kept = [], []
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            frozen = not module.gate_up_proj.requires_grad
            if frozen and _held(stored, name, (".gate_up_proj", ".down_proj"), released=True):
                converted += [name for _ in quantize_experts(module, block)]
            continue
        released = name.startswith(FP8_LAYERS) and name.endswith(CONVERTED)
        if not _held(stored, name, (".weight",), released):
            continue
        if stored is None and not isinstance(module, nn.Linear):
            raise ValueError(f"{name} is a {type(module).__name__}, not a linear projection")
        if isinstance(module, nn.Linear) and not module.weight.requires_grad:
            _convert(module, form)
            converted.append(name)
        else:  # trained in full, or not a projection: computed in full precision
            kept.append(name)
    if kept:
        logger.info(
            "held in full precision (trained in full, or not a linear projection), their "
            "float8 on disk dequantized on load: %s",
            ", ".join(kept),
        )
    return converted


def _held(stored: set[str] | None, name: str, weights: tuple[str, ...], released: bool) -> bool:
    """Whether module ``name`` (its ``weights``) is held in FP8: stored so, or without
    ``stored`` by the release rule (``released``)."""
    if stored is None:
        return released
    return all(f"{name}{w}" in stored for w in weights)


def fp8_summary(params) -> str:
    """The modules held in FP8 by kind and the bytes of the whole model's weights: float8,
    their scales, the rest (``params``: :func:`qwen35_trainer.model.whole.whole_parameters`,
    full shapes)."""
    kinds: dict[str, int] = {}
    fp8 = scales = rest = 0
    for p in params:
        size = math.prod(p.param.shape) * p.param.element_size()
        if p.param.dtype == torch.float8_e4m3fn:
            fp8 += size
            kind = _kind(p.name)
            kinds[kind] = kinds.get(kind, 0) + 1
        elif p.name.endswith("_scale_inv"):
            scales += size
        else:
            rest += size
    held = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"
    return (
        f"FP8 modules: {held}; the base holds {_size(fp8)} in float8, {_size(scales)} of "
        f"scales, {_size(rest)} in its other dtypes"
    )


def _size(size: int) -> str:
    """``size`` bytes in MiB below a GiB, else GiB (3 significant digits)."""
    return f"{size / 2**20:.3g} MiB" if size < 2**30 else f"{size / 2**30:.3g} GiB"


def _kind(name: str) -> str:
    """The kind of FP8 weight ``name`` (the MTP head's counted apart)."""
    head = "MTP-head " if name.startswith("mtp.") else ""
    if ".experts." in name:
        return f"{head}routed-expert weights"
    for key, kind in (
        ("self_attn.", "attention"),
        ("linear_attn.", "Gated DeltaNet"),
        ("shared_expert.", "shared-expert"),
    ):
        if key in name:
            return f"{head}{kind} projections"
    return f"{head}other projections"


def converted_form(name: str, block: tuple[int, int]) -> BlockFormat | None:
    """The block format of weight ``name`` (canonical) when Qwen's FP8 releases convert it
    (module docstring), else ``None``: what an FP8 export quantizes."""
    if not name.startswith(FP8_LAYERS):
        return None
    if name.endswith(tuple(f"{c}.weight" for c in CONVERTED)):
        return BlockFormat(tuple(block))
    for weight, (_, parts) in EXPERT_FP8.items():
        if name.endswith(f".experts.{weight}"):
            return BlockFormat(tuple(block), parts)
    return None


def dequantized(module: nn.Module, attr: str, full) -> torch.Tensor | None:
    """The whole dequantized value (fp32) of ``module``'s FP8 weight ``attr``, or ``None``
    when it is not one; ``full`` gathers a (sharded) parameter whole."""
    form = getattr(module, "fp8_form", None)
    if form is not None and attr == "weight":
        return dequantize(full(module.weight), full(module.weight_scale_inv), form)
    block = getattr(module, "fp8_block", None)
    if block is None or attr not in EXPERT_FP8:
        return None
    scale, parts = EXPERT_FP8[attr]
    form = BlockFormat(block, parts)
    return dequantize(full(getattr(module, attr)), full(getattr(module, scale)), form)
