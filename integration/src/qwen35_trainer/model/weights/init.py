"""A random initialisation that every layout reproduces exactly: each parameter's value is a
function of the run's seed, its name and its full shape only.

The distributions are transformers' own for this model (``Qwen3_5MoePreTrainedModel.
_init_weights``; :func:`init_rule` states them, a test compares them with transformers'): linear,
convolution, embedding, router and expert weights ``normal(0, initializer_range)``, biases 0,
the zero-centred ``Qwen3_5MoeRMSNorm`` weights 0, the other norms 1 / 0, the Gated DeltaNet's
``dt_bias`` 1 and ``A_log = log(uniform(0.01, 16))``, the embedding's padding row 0. LoRA
adapters (:mod:`qwen35_trainer.model.lora.adapters`): ``A`` Kaiming-uniform (``uniform(±1/sqrt(in))``,
a Linear's default), ``B`` 0.

Why a shard equals the one-process tensor: the full tensor is cut along dim 0 into blocks of
at most :data:`BLOCK_ELEMENTS` elements (``rows_per_block`` depends on the shape only), and
block ``b`` is drawn from its own generator seeded by ``sha256(seed, name, b)``. A rank
generates only the blocks its shard's dim-0 span touches (:func:`qwen35_trainer.model.shards.
read_local`), so one expert's rows are drawn without the 255 others, and every layout, the
single process included, sees the same numbers in the same places.

:class:`SeededInit` is this initialisation as a weight source
(:mod:`qwen35_trainer.model.weights.sources`): it fills every parameter; a weight held in FP8
gets the quantized seeded value (its bytes, or its scales: :mod:`qwen35_trainer.model.fp8.load`).
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from moe_parallel.moe import Experts
from qwen35_trainer.model.fp8.load import fp8_role, quantized_reader
from qwen35_trainer.model.lora.adapters import LoRALinear
from qwen35_trainer.model.weights.sources import RowReader
from qwen35_trainer.model.whole import WholeParameter

__all__ = ["BLOCK_ELEMENTS", "SeededInit", "init_rows", "init_rule"]

# Elements per independently seeded block of a parameter (16 MiB of fp32).
BLOCK_ELEMENTS = 1 << 22


def init_rule(module: nn.Module, name: str, std: float) -> tuple:
    """How ``module``'s parameter ``name`` starts: ``("normal", std)``, ``("zeros",)``,
    ``("ones",)``, ``("uniform", bound)`` or ``("log_uniform", lo, hi)``; ``ValueError`` for a
    parameter no rule covers (a new transformers module must be given one, not left
    uninitialised)."""
    kinds = {cls.__name__ for cls in type(module).__mro__}  # FSDP2 subclasses the unit
    kind = type(module).__name__
    if "Qwen3_5MoeGatedDeltaNet" in kinds:
        rules = {"dt_bias": ("ones",), "A_log": ("log_uniform", 0.01, 16.0)}
    elif "Qwen3_5MoeRMSNorm" in kinds:
        rules = {"weight": ("zeros",)}
    elif any("RMSNorm" in k or "LayerNorm" in k for k in kinds):
        rules = {"weight": ("ones",), "bias": ("zeros",)}
    elif isinstance(module, LoRALinear):
        rules = {
            "weight": ("normal", std),
            "bias": ("zeros",),
            "lora_A": ("uniform", 1.0 / math.sqrt(module.in_features)),
            "lora_B": ("zeros",),
        }
    elif isinstance(module, nn.Linear | nn.Conv1d | nn.Conv3d | nn.Embedding):
        rules = {"weight": ("normal", std), "bias": ("zeros",)}

    elif "Qwen3_5MoeTopKRouter" in kinds:
        rules = {"weight": ("normal", std)}
    elif isinstance(module, Experts):
        rules = {"gate_up_proj": ("normal", std), "down_proj": ("normal", std)}
        for part in ("gate_up", "down"):  # LoRA adapters: A [E, r, in], B [E, out, r]
            a = getattr(module, f"lora_{part}_A", None)
            if a is not None:
                rules[f"lora_{part}_A"] = ("uniform", 1.0 / math.sqrt(a.shape[-1]))
                rules[f"lora_{part}_B"] = ("zeros",)
    else:
        rules = {}
    if name not in rules:
        raise ValueError(f"no initialisation rule for parameter {name!r} of {kind}")
    return rules[name]


def _generator(seed: int, name: str, block: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}:{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _draw(rule: tuple, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if rule[0] == "normal":
        return torch.empty(shape).normal_(0.0, rule[1], generator=gen)
    if rule[0] == "log_uniform":
        return torch.empty(shape).uniform_(rule[1], rule[2], generator=gen).log_()
    if rule[0] == "uniform":
        return torch.empty(shape).uniform_(-rule[1], rule[1], generator=gen)
    return torch.zeros(shape) if rule[0] == "zeros" else torch.ones(shape)


def init_rows(
    rule: tuple,
    seed: int,
    name: str,
    shape: torch.Size,
    lo: int,
    hi: int,
    padding_row: int | None = None,
) -> torch.Tensor:
    """Rows ``lo:hi`` (dim 0) of the full fp32 initial value of parameter ``name``."""
    row = tuple(shape[1:])
    per_block = max(1, BLOCK_ELEMENTS // max(1, math.prod(row)))
    parts = []
    for block in range(lo // per_block, -(-hi // per_block)):
        start = block * per_block
        rows = min(per_block, shape[0] - start)
        values = _draw(rule, (rows, *row), _generator(seed, name, block))
        parts.append(values[max(lo - start, 0) : min(hi - start, rows)])
    out = torch.cat(parts) if parts else torch.zeros((0, *row))
    if padding_row is not None and lo <= padding_row < hi:
        out[padding_row - lo] = 0.0
    return out


class SeededInit:
    """The name-seeded initialisation of run seed ``seed`` (``std``: the config's
    ``initializer_range``) as a weight source: a reader for every parameter this rank holds."""

    def __init__(self, seed: int, std: float) -> None:
        self.seed, self.std = seed, std

    def plan(self, whole: list[WholeParameter], problems: list[str]) -> dict[str, RowReader]:
        return {p.name: self.reader(p.name, p.module, p.attr, p.param) for p in whole if p.here}

    def refusal(self, problems: list[str]) -> str:
        return "; ".join(problems)

    def reader(self, name: str, module: nn.Module, attr: str, param) -> RowReader:
        """Rows of ``module``'s parameter ``attr`` (full name ``name``), fp32; of an FP8 weight's
        bytes or scales, those of its quantized seeded value."""
        role = fp8_role(module, attr)
        if role is not None:
            weight = name.removesuffix(attr) + role.weight
            rule = init_rule(module, role.weight, self.std)
            return quantized_reader(
                lambda lo, hi: init_rows(rule, self.seed, weight, role.shape, lo, hi), role
            )
        rule = init_rule(module, attr, self.std)
        padding = getattr(module, "padding_idx", None) if attr == "weight" else None
        shape = param.shape
        return lambda lo, hi: init_rows(rule, self.seed, name, shape, lo, hi, padding_row=padding)
