"""Build on the meta device, parallelise there, then materialise each rank's shards only.

:func:`build_meta_model` makes transformers' ``Qwen3_5MoeForConditionalGeneration`` with
:class:`moe_parallel.MoE` blocks (:mod:`qwen35_trainer.model.config`) without allocating a
byte of weights, so a 122B model is built in seconds and the parallel stage (TP, EP, AC, FSDP)
only rewraps meta tensors. :func:`materialize` then allocates every parameter's LOCAL shard on
the device (``to_empty``) and fills it, one parameter at a time, from its weight sources
(:func:`weight_sources`, :mod:`qwen35_trainer.model.weights.sources`): the name-seeded
initialisation (:mod:`qwen35_trainer.model.weights.init`), so every layout starts from the
one-process weights exactly; over it ``model.weights``, a transformers checkpoint directory of
which each rank reads the slices its shards need (:mod:`qwen35_trainer.model.weights.load`);
over both, LoRA's ``init_from`` adapter folder (:mod:`qwen35_trainer.model.lora.peft_import`).

The only buffers (the rotary embeddings' inverse frequencies, non-persistent) are recomputed by
transformers' own rule (:func:`materialize_buffers`). One filler, :func:`module_filler`,
fills a module's parameters by their names either way; megatron-fsdp, which materialises the
meta model one unit at a time itself, calls it module by module
(:mod:`qwen35_trainer.parallel.megatron`). :func:`build_model` is the one-process shortcut: meta
build + materialise on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moe_parallel import MoE, swap_moe_blocks
from qwen35_trainer.model.config import build_config
from qwen35_trainer.model.fp8.hold import hold_base_in_fp8
from qwen35_trainer.model.lora.adapters import add_lora
from qwen35_trainer.model.lora.peft_import import AdapterSource
from qwen35_trainer.model.mtp import add_mtp
from qwen35_trainer.model.packed import enable_packing
from qwen35_trainer.model.params import named_parameters
from qwen35_trainer.model.weights.adapter import fp8_weights
from qwen35_trainer.model.weights.files import open_files
from qwen35_trainer.model.weights.init import SeededInit
from qwen35_trainer.model.weights.load import CheckpointSource
from qwen35_trainer.model.weights.shards import local_index, read_local
from qwen35_trainer.model.weights.sources import WeightSource, plan_fill
from qwen35_trainer.recipe import ModelRecipe

__all__ = [
    "build_meta_model",
    "build_model",
    "checkpoint_block",
    "fill_settings",
    "init_parameters",
    "materialize",
    "materialize_buffers",
    "module_filler",
    "moe_blocks",
    "weight_sources",
]


def moe_blocks(model: nn.Module) -> list[MoE]:
    """The model's :class:`MoE` blocks in module order (decoder layer order)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def build_meta_model(model_recipe: ModelRecipe, *, packing: bool = False) -> nn.Module:
    """The recipe's model (its multi-token-prediction head ``mtp`` added when
    ``model.mtp_layers`` asks for one, :mod:`qwen35_trainer.model.mtp`; MoE swapped; with
    ``model.lora`` its adapters added and the rest frozen, :mod:`qwen35_trainer.model.lora.adapters`;
    with ``model.fp8_base`` its frozen projections and experts held in FP8,
    :mod:`qwen35_trainer.model.fp8.hold`; with
    ``packing`` adapted to packed rows, :func:`qwen35_trainer.model.packed.enable_packing`) on
    the meta device: shapes only, no storage."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    config = build_config(model_recipe)
    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(config)
        add_mtp(model)
        swap_moe_blocks(model, expert_backend=model_recipe.expert_backend)
        if model_recipe.lora is not None:
            add_lora(model, model_recipe.lora)
        if model_recipe.fp8_base:
            hold_base_in_fp8(model, model_recipe.block, _stored_fp8(model_recipe))
    if packing:
        enable_packing(
            model,
            attention_backend=model_recipe.attention_backend,
            gdn_backend=model_recipe.gdn_backend,
        )
    return model


def _stored_fp8(model_recipe: ModelRecipe) -> set[str] | None:
    """The weights the recipe's FP8 checkpoint stores in float8 (read from its files'
    headers), or ``None`` when the base is quantized on load (a bf16 checkpoint, or none)."""
    if model_recipe.quantization is None or model_recipe.weights_dir is None:
        return None
    return fp8_weights(open_files(model_recipe.weights_dir))


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def weight_sources(
    model: nn.Module,
    *,
    seed: int = 0,
    weights: str | None = None,
    init_missing_mtp: bool = False,
    block: tuple[int, int] | None = None,
    lora: Any = None,
    window_bytes: int | None = None,
) -> list[WeightSource]:
    """Where ``model``'s parameters start from, in order (:mod:`qwen35_trainer.model.weights.
    sources`): the name-seeded initialisation of ``seed``, then the checkpoint directory
    ``weights`` (``block``: its FP8 ``weight_block_size``; ``init_missing_mtp``: a checkpoint
    without ``mtp.*`` leaves the head to the seeded values), then ``lora.init_from``'s adapter
    folder (the recipe's ``model.lora``)."""
    sources: list[WeightSource] = [SeededInit(seed, model.config.text_config.initializer_range)]
    if weights is not None:
        sources.append(
            CheckpointSource(
                weights, block=block, init_missing_mtp=init_missing_mtp, window_bytes=window_bytes
            )
        )
    if lora is not None and lora.init_from:
        sources.append(AdapterSource(lora.init_from, lora, getattr(model, "lora_trained", ())))
    return sources


def init_parameters(model: nn.Module, seed: int, names: set[str] | None = None) -> None:
    """Fill every (materialised) parameter's local shard — or only those of ``names`` — with
    its name-seeded initial value."""
    init = SeededInit(seed, model.config.text_config.initializer_range)
    with torch.no_grad():
        for name, module, attr, param in named_parameters(model):
            if names is None or name in names:
                value = read_local(init.reader(name, module, attr, param), local_index(param))
                _local(param).copy_(value)


def module_filler(model: nn.Module, device: torch.device | str, **sources: Any):
    """``fill(module, keep=None)``: fills the local shards of ``module``'s own (materialised)
    parameters as :func:`materialize` does — from :func:`weight_sources` of ``sources`` — and
    hands each parameter with its value before the cast to the parameter's dtype to
    ``keep(param, value)``. Before returning, ``model``'s buffers are materialised on
    ``device`` (:func:`materialize_buffers`) and every source is planned and checked against
    the whole model, every rank agreeing on ``device``; ``model``'s parameters may still be on
    the meta device. Modules without parameters of their own are left as they are."""
    materialize_buffers(model, device)
    readers = plan_fill(model, weight_sources(model, **sources), device)
    owned: dict[nn.Module, list[tuple[str, str]]] = {}
    for name, module, attr, _ in named_parameters(model):
        owned.setdefault(module, []).append((name, attr))

    def fill(module: nn.Module, keep: Callable | None = None) -> None:
        if module not in owned and next(module.parameters(recurse=False), None) is not None:
            raise ValueError(f"{type(module).__name__} holds parameters outside the model")
        with torch.no_grad():
            for name, attr in owned.get(module, ()):
                param = module._parameters[attr]
                value = read_local(readers[name], local_index(param))
                _local(param).copy_(value)
                if keep is not None:
                    keep(param, value)

    return fill


def materialize_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Allocate the buffers still on the meta device on ``device`` and (re)compute every
    buffer by transformers' rule — the rotary embeddings' inverse frequencies, the model's only
    buffers (any other is a ``ValueError``: it would need a rule of its own)."""
    for path, module in model.named_modules():
        buffers = dict(module.named_buffers(recurse=False))
        if not buffers:
            continue
        if "RotaryEmbedding" not in type(module).__name__ or not hasattr(
            module, "original_inv_freq"
        ):
            raise ValueError(f"no rule to rebuild the buffers of {path} ({type(module).__name__})")
        for attr, buffer in buffers.items():
            if buffer.is_meta:
                module._buffers[attr] = torch.empty_like(buffer, device=device)
        with torch.no_grad():
            model._init_weights(module)  # transformers' rule: inv_freq from the rope config


def materialize(model: nn.Module, device: torch.device | str, **sources: Any) -> nn.Module:
    """Allocate the meta ``model``'s local shards on ``device`` and fill them from
    :func:`weight_sources` of ``sources`` (``seed``, ``weights``, ``init_missing_mtp``,
    ``block``, ``lora``; module docstring); in place, returns ``model``."""
    model.to_empty(device=device)
    fill = module_filler(model, device, **sources)
    for module in model.modules():
        fill(module)
    return model


def fill_settings(model_recipe: ModelRecipe, seed: int) -> dict[str, Any]:
    """What :func:`materialize` and :func:`module_filler` fill a model of ``model_recipe``
    from (:func:`weight_sources`' arguments): the one place a recipe becomes weight sources."""
    return {
        "seed": seed,
        "weights": model_recipe.weights_dir,
        "init_missing_mtp": model_recipe.init_missing_mtp,
        "block": checkpoint_block(model_recipe),
        "lora": model_recipe.lora,
    }


def build_model(model_recipe: ModelRecipe, *, seed: int = 0) -> nn.Module:
    """The recipe's model on the host, unsharded: name-seeded random weights, or
    ``model_recipe.weights`` loaded."""
    return materialize(build_meta_model(model_recipe), "cpu", **fill_settings(model_recipe, seed))


def checkpoint_block(model_recipe: ModelRecipe) -> tuple[int, int] | None:
    """The FP8 blocks of the recipe's checkpoint (its ``quantization_config``), or ``None``."""
    return model_recipe.block if model_recipe.quantization is not None else None
