"""Which kernel each layer kind runs, decided once per run and reported.

``model.attention_backend`` (``auto`` / ``torch`` / ``torch_varlen`` / ``flash``),
``model.gdn_backend`` (``auto`` / ``torch`` / ``fla``), ``model.expert_backend`` (``auto`` /
``torch`` / ``te``) and ``train.optimizer`` (``auto`` / ``adamw`` / ``adam`` / ``te_fused_adam``):
``auto`` takes the fast GPU kernel where it can run (the run is on CUDA, its package imports;
attention's varlen kernels in bf16), else the torch path; a named backend that cannot run here
is an error before anything is built (:func:`resolve_kernels`, called where
the layout is validated). The packages decide the same way when the layers run
(:func:`cp_varlen_attn.resolve_attention_backend` / :func:`cp_varlen_attn.resolve_gdn_backend` are
the rules :func:`cp_varlen_attn.varlen_attention` / :func:`cp_varlen_attn.gated_delta_rule`
apply, moe-parallel's ``te`` test is TransformerEngine importing on CUDA), so the report names what
runs. A frozen base held in FP8 (:mod:`qwen35_trainer.model.fp8.hold`) adds its line: on a GPU
that runs torch's block-scaled FP8 GEMM (:func:`moe_parallel.fp8_gemm.block_scaled_mm_supported`:
compute capability 9.x) with 128 × 128 blocks in bf16, its projections go through it
(``scaled_mm``); elsewhere, and for the routed experts, its blocks are dequantized per use and
multiplied in the compute dtype (``dequantize``). On CUDA, ``auto`` running the per-piece SDPA
loop (an fp32 run: the varlen kernels take bf16/fp16) or the torch chunked GDN rule (fla not
installed) is a WARNING saying why (:attr:`Kernels.fallbacks`): Qwen3.5 trains 2-4x slower
there, and nothing else would say so. The experts' ``torch._grouped_mm`` and torch's fused AdamW (``adamw`` on
CUDA) are fast paths, not fallbacks; TransformerEngine's are opt-in (the ``te`` extra).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["Kernels", "resolve_kernels"]

# per layer kind: (recipe key, {kernel: what the report calls it})
_NAMES = {
    "attention": (
        "model.attention_backend",
        {
            "flash": "flash-attn varlen",
            "torch_varlen": "torch varlen_attn",
            "torch": "torch SDPA per document piece",
        },
    ),
    "gated delta rule": (
        "model.gdn_backend",
        {"fla": "fla chunk_gated_delta_rule", "torch": "torch chunked rule"},
    ),
    "experts": (
        "model.expert_backend",
        {"te": "TransformerEngine grouped GEMM", "torch": "torch grouped mm"},
    ),
    "frozen base": (
        "model.base_dtype",
        {
            "scaled_mm": "FP8 GEMM (torch scaled_mm, 1x128 activation / 128x128 weight blocks) "
            "for the projections of dims multiple of 128, the routed experts dequantized per use",
            "dequantize": "FP8 blocks dequantized per use, bf16/fp32 GEMM (no FP8 GEMM path "
            "here: torch's block-scaled GEMM takes 128x128 blocks in bf16 on compute "
            "capability 9.x)",
        },
    ),
    "optimizer": (
        "train.optimizer",
        {
            "te_fused_adam": "TransformerEngine fused Adam",
            "adamw": "torch AdamW",
            "adam": "torch Adam",
        },
    ),
}


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The resolved kernel of each layer kind (``attention``, ``gated delta rule``, ``experts``:
    backend names as the packages take them; ``optimizer``: a :func:`safe_optim.build_optimizer`
    name) and the WARNINGs of ``auto`` falling back to a torch path on CUDA."""

    chosen: dict[str, str]
    fallbacks: tuple[str, ...] = ()

    def line(self) -> str:
        """The report: ``kernels: attention torch SDPA per document piece (torch), ...``."""
        parts = [f"{kind} {_NAMES[kind][1][k]} ({k})" for kind, k in self.chosen.items()]
        return "kernels: " + ", ".join(parts)

    def record(self) -> dict[str, str]:
        """``{layer kind: kernel}`` for ``metrics.jsonl``'s header and the run folder."""
        return dict(self.chosen)


def _te_available() -> bool:
    from moe_parallel.te_backend import te_available

    return te_available()


def resolve_kernels(recipe: Any, device_type: str) -> Kernels:
    """The kernels ``recipe`` runs on ``device_type``; ``ValueError`` naming every named backend
    that cannot run there."""
    from cp_varlen_attn import resolve_attention_backend, resolve_gdn_backend

    model, optimizer = recipe.model, recipe.train.optimizer
    dtype = getattr(torch, recipe.train.dtype)
    cuda = device_type == "cuda"
    te = cuda and _te_available()
    # expert LoRA runs inside the torch grouped path (TE's fused experts have no place for it)
    expert_lora = model.lora is not None and "experts" in model.lora.targets
    chosen, errors = {}, []
    for kind, resolve, asked in (
        (
            "attention",
            lambda b: resolve_attention_backend(b, device_type, dtype),
            model.attention_backend,
        ),
        ("gated delta rule", lambda b: resolve_gdn_backend(b, device_type), model.gdn_backend),
        ("experts", lambda b: _experts(b, te, expert_lora), model.expert_backend),
        (
            "optimizer",
            lambda b: _pick(b, ("auto", "adamw", "adam", "te_fused_adam"), "te_fused_adam", te),
            optimizer,
        ),
    ):
        try:
            chosen[kind] = resolve(asked)
        except ValueError as err:
            errors.append(f"{_NAMES[kind][0]}={asked}: {err}")
    if errors:
        raise ValueError("; ".join(errors))
    if model.fp8_base:
        chosen = {**chosen, "frozen base": _frozen_base(model.block, dtype, device_type)}
    why = {
        "attention": f"train.dtype={recipe.train.dtype}, and the varlen kernels take bfloat16 "
        "(train.dtype=bfloat16 runs torch's varlen_attn)"
        if dtype == torch.float32
        else f"torch {torch.__version__} has no torch.nn.attention.varlen and flash-attn is not "
        "installed",
        "gated delta rule": "install flash-linear-attention (pip install 'qwen35-trainer[gpu]') "
        "for the fast kernel",
    }
    fallbacks = tuple(
        f"{_NAMES[kind][0]}=auto on CUDA runs the {_NAMES[kind][1][k]} (slow): {why[kind]}"
        for kind, k in chosen.items()
        if cuda and kind in why and k == "torch" and _asked(recipe, kind) == "auto"
    )
    return Kernels(chosen, fallbacks)


def _frozen_base(block: tuple[int, int], dtype: torch.dtype, device_type: str) -> str:
    if device_type != "cuda" or dtype != torch.bfloat16:
        return "dequantize"
    from moe_parallel.fp8_gemm import BLOCK, block_scaled_mm_supported

    gemm = tuple(block) == (BLOCK, BLOCK) and block_scaled_mm_supported(torch.device("cuda"))
    return "scaled_mm" if gemm else "dequantize"


def _asked(recipe: Any, kind: str) -> str:
    section, key = _NAMES[kind][0].split(".")
    return getattr(getattr(recipe, section), key)


def _experts(asked: str, te: bool, lora: bool) -> str:
    if lora and asked == "te":
        raise ValueError(
            "expert LoRA (model.lora.targets has experts) runs on the torch grouped path: "
            "TransformerEngine's fused experts have no place for the adapters"
        )
    return _pick(asked, ("auto", "torch", "te"), "te", te and not lora)


def _pick(asked: str, names: tuple[str, ...], fast: str, available: bool) -> str:
    if asked not in names:
        raise ValueError(f"expected one of {names}")
    if asked == fast and not available:
        raise ValueError("needs TransformerEngine and a CUDA device")
    if asked == "auto":
        return fast if available else names[1]
    return asked
