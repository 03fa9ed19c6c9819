"""The Qwen3.5 MoE-VLM: transformers' model with this workspace's MoE blocks.

The model is transformers' own ``Qwen3_5MoeForConditionalGeneration`` (vision tower, hybrid
Gated-DeltaNet / attention decoder, multimodal RoPE, ``lm_head``), so HF checkpoints load as
they are and transformers stays the parity oracle. Every ``Qwen3_5MoeSparseMoeBlock`` is then
replaced by :class:`moe_parallel.MoE` (:func:`moe_parallel.swap_moe_blocks`) holding the same
tensors under the same names
(``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``, ``shared_expert.*``,
``shared_expert_gate.weight``): the state dict does not change, and the block gains dropless
expert parallelism, zero grads for idle experts and per-step router statistics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moe_parallel import MoE, swap_moe_blocks
from qwen35_trainer.recipe import ModelRecipe

__all__ = ["build_config", "build_model", "moe_blocks", "swap_moe_blocks"]


def _checked(name: str, config_cls: type, values: dict[str, Any]) -> dict[str, Any]:
    default = config_cls()
    unknown = sorted(k for k in values if not hasattr(default, k))
    if unknown:
        raise ValueError(f"model.{name}: {config_cls.__name__} has no field(s) {unknown}")
    return values


def build_config(spec: ModelRecipe) -> Any:
    """The transformers ``Qwen3_5MoeConfig`` a recipe's ``model`` section describes."""
    from transformers import Qwen3_5MoeConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
        Qwen3_5MoeTextConfig,
        Qwen3_5MoeVisionConfig,
    )

    config = Qwen3_5MoeConfig(
        text_config=_checked("text", Qwen3_5MoeTextConfig, spec.text),
        vision_config=_checked("vision", Qwen3_5MoeVisionConfig, spec.vision),
        image_token_id=spec.image_token_id,
        video_token_id=spec.video_token_id,
        vision_start_token_id=spec.vision_start_token_id,
        vision_end_token_id=spec.vision_end_token_id,
    )
    vocab = config.text_config.vocab_size
    ids = {k: getattr(spec, k) for k in ("image_token_id", "video_token_id",
                                         "vision_start_token_id", "vision_end_token_id")}  # fmt: skip
    outside = {k: v for k, v in ids.items() if not 0 <= v < vocab}
    if outside:
        raise ValueError(f"model token ids {outside} lie outside the vocabulary [0, {vocab})")
    return config


def moe_blocks(model: nn.Module) -> list[MoE]:
    """The model's :class:`MoE` blocks in module order (decoder layer order)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def build_model(spec: ModelRecipe, *, seed: int = 0) -> nn.Module:
    """The recipe's model, MoE swapped: randomly initialised (seeded: every rank builds the
    same weights), or with ``spec.weights`` loaded from a transformers checkpoint."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    config = build_config(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5MoeForConditionalGeneration(config)
    swap_moe_blocks(model, expert_backend=spec.expert_backend)
    if spec.weights is not None:
        from qwen35_trainer.hf import load_hf_weights

        load_hf_weights(model, spec.weights)
    return model
