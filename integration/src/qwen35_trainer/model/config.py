"""The recipe's transformers config of the Qwen3.5 MoE-VLM, checked before anything is built.

The model (:mod:`qwen35_trainer.model.build`) is transformers' own ``Qwen3_5MoeForConditionalGeneration`` (vision tower, hybrid
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

from qwen35_trainer.model.weights.files import folder_problem
from qwen35_trainer.recipe import ModelRecipe

__all__ = ["build_config", "check_shapes"]


# config.json keys of the public checkpoints that transformers' config class does not declare
# (it keeps them as plain attributes): the multi-token-prediction depth (:mod:`.mtp`).
UNDECLARED_TEXT_KEYS = ("mtp_num_hidden_layers",)


def _checked(name: str, config_cls: type, values: dict[str, Any]) -> dict[str, Any]:
    default = config_cls()
    known = UNDECLARED_TEXT_KEYS if name == "text" else ()
    unknown = sorted(k for k in values if not hasattr(default, k) and k not in known)
    if unknown:
        raise ValueError(f"model.{name}: {config_cls.__name__} has no field(s) {unknown}")
    return values


def build_config(model_recipe: ModelRecipe) -> Any:
    """The transformers ``Qwen3_5MoeConfig`` a recipe's ``model`` section describes."""
    from transformers import Qwen3_5MoeConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
        Qwen3_5MoeTextConfig,
        Qwen3_5MoeVisionConfig,
    )

    text, vision = model_recipe.text, model_recipe.vision
    if (
        model_recipe.path is None
    ):  # else they are config.json's (model_path), keys beyond the defaults too
        text = _checked("text", Qwen3_5MoeTextConfig, text)
        vision = _checked("vision", Qwen3_5MoeVisionConfig, vision)
    try:
        config = Qwen3_5MoeConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=model_recipe.image_token_id,
            video_token_id=model_recipe.video_token_id,
            vision_start_token_id=model_recipe.vision_start_token_id,
            vision_end_token_id=model_recipe.vision_end_token_id,
        )
    except Exception as err:  # transformers' own validators (their error types vary)
        reason = " ".join(str(err).split())
        raise ValueError(
            f"model.text / model.vision: transformers refuses the config: {reason}"
        ) from err
    vocab = config.text_config.vocab_size
    ids = {
        k: getattr(model_recipe, k)
        for k in (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        )
    }
    outside = {k: v for k, v in ids.items() if not 0 <= v < vocab}
    if outside:
        raise ValueError(f"model token ids {outside} lie outside the vocabulary [0, {vocab})")
    check_shapes(config)
    # what the model builds and an export's config.json states (servers read it to load mtp.*)
    if model_recipe.mtp_depth or "mtp_num_hidden_layers" in text:
        config.text_config.mtp_num_hidden_layers = model_recipe.mtp_depth
    problem = model_recipe.weights and folder_problem(model_recipe.weights)
    if problem:
        raise ValueError(problem)
    return config


def check_shapes(config: Any) -> None:
    """``ValueError`` listing every inconsistency of the text and vision configs that would
    otherwise surface as a shape error deep inside the first forward."""
    text, vision = config.text_config, config.vision_config
    rules = {
        "model.vision.out_hidden_size equals model.text.hidden_size (vision features are "
        "placed into the text embeddings)": vision.out_hidden_size == text.hidden_size,
        "model.text.num_key_value_heads divides num_attention_heads": text.num_attention_heads
        % text.num_key_value_heads
        == 0,
        "model.text.linear_num_key_heads divides linear_num_value_heads": text.linear_num_value_heads
        % text.linear_num_key_heads
        == 0,
        "model.text.layer_types has num_hidden_layers entries": len(text.layer_types)
        == text.num_hidden_layers,
        "model.text.num_experts_per_tok <= num_experts": text.num_experts_per_tok
        <= text.num_experts,
        "model.vision.num_heads divides hidden_size": vision.hidden_size % vision.num_heads == 0,
    }
    failed = [rule for rule, ok in rules.items() if not ok]
    if failed:
        got = (
            f"text hidden {text.hidden_size}, heads {text.num_attention_heads}/"
            f"{text.num_key_value_heads}, linear heads {text.linear_num_key_heads}/"
            f"{text.linear_num_value_heads}, layers {text.num_hidden_layers} with "
            f"{len(text.layer_types)} layer_types, experts {text.num_experts} top "
            f"{text.num_experts_per_tok}; vision hidden {vision.hidden_size}, heads "
            f"{vision.num_heads}, out {vision.out_hidden_size}"
        )
        raise ValueError(
            "model shapes do not fit together: expected " + "; ".join(failed) + f" (got {got})"
        )
