"""The ``config.json`` fields vLLM and SGLang read to serve a Qwen3.5 MoE checkpoint, listed
from their loaders' source (read, not copied; docs/serving.md has the commands):

- vLLM, main branch as stored at these commits: ``vllm/transformers_utils/configs/qwen3_5_moe.py``
  (030ea52: the config class, every field with a default of its own), ``model_executor/models/
  qwen3_5.py`` (00def4f: layers, embeddings, ``layer_types``), ``qwen3_next.py`` (002d607:
  attention, its rotary embedding through ``get_rope``, the MoE block), ``qwen3_5_mtp.py``
  (01d9980: the MTP head); vLLM's ``get_rope`` builds M-RoPE only when ``rope_parameters`` has
  ``mrope_section`` and interleaves only with ``mrope_interleaved: true``.
- SGLang, main branch: ``python/sglang/srt/configs/qwen3_5.py`` (0f6f000), ``configs/
  qwen3_next.py`` (041bacd: ``layers_block_type`` from ``full_attention_interval``),
  ``models/qwen3_5.py`` (005fa71), ``rope_parameters["rope_theta"]`` through its
  ``get_rope_config``.

A field a server reads but ``config.json`` lacks takes that server's default, which describes
one released size (vLLM's: 40 layers, 256 experts, a vocabulary of 248320; SGLang's: Qwen3-Next's
48 layers and 512 experts), so each one must be written, with the model's value. A few are read
with a default that is what transformers' Qwen3.5 MoE always computes (:data:`DEFAULTED`): they
may be absent, never different.
"""

from __future__ import annotations

from typing import Any

TOP = (
    "architectures",
    "model_type",
    "text_config",
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "tie_word_embeddings",
)
TEXT = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "layer_types",
    "full_attention_interval",
    "rms_norm_eps",
    "hidden_act",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rope_parameters",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "tie_word_embeddings",
)
ROPE = ("rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
VISION = (
    "depth",
    "hidden_size",
    "hidden_act",
    "intermediate_size",
    "num_heads",
    "in_channels",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "out_hidden_size",
    "num_position_embeddings",
)
DEFAULTED = {
    "attn_output_gate": True,  # transformers' Qwen3.5 attention always gates its output
    "norm_topk_prob": True,  # ... and always renormalises the top-k router weights
    "qkv_bias": False,
    "attention_bias": False,
    "layer_scale": False,
    "decoder_sparse_step": 1,  # every layer is MoE
    "mlp_only_layers": [],
    "output_gate_type": None,
}
MTP = ("mtp_num_hidden_layers",)  # vLLM's and SGLang's MTP drafters
FP8 = ("quant_method", "activation_scheme", "weight_block_size")  # their block-FP8 loaders


def check_served_fields(written: dict, config: Any, *, mtp: bool = False) -> None:
    """``written`` (an export's ``config.json``) holds every field above with the value of
    ``config`` (the model's transformers config), the M-RoPE split the model ran with (its
    rotary embedding's ``[11, 11, 10]`` default when the recipe names none), interleaved, and
    the period of its layer kinds."""
    missing = [k for k in TOP if k not in written]
    text, vision = written.get("text_config", {}), written.get("vision_config", {})
    missing += [f"text_config.{k}" for k in TEXT if k not in text]
    missing += [f"text_config.rope_parameters.{k}" for k in ROPE
                if k not in text.get("rope_parameters", {})]  # fmt: skip
    missing += [f"vision_config.{k}" for k in VISION if k not in vision]
    missing += [f"text_config.{k}" for k in MTP if mtp and k not in text]
    if "quantization_config" in written:
        missing += [f"quantization_config.{k}" for k in FP8
                    if k not in written["quantization_config"]]  # fmt: skip
    assert not missing, f"config.json lacks what vLLM / SGLang read: {missing}"
    for key in TEXT:
        if key not in ("model_type", "rope_parameters", "full_attention_interval"):
            assert text[key] == _plain(getattr(config.text_config, key)), key
    for key in VISION:
        if key != "model_type":
            assert vision[key] == _plain(getattr(config.vision_config, key)), key
    rope = text["rope_parameters"]
    want = dict(config.text_config.rope_parameters)
    assert rope["mrope_section"] == want.get("mrope_section", [11, 11, 10])
    assert rope["mrope_interleaved"] is True
    assert all(rope[k] == want[k] for k in ("rope_type", "rope_theta", "partial_rotary_factor"))
    kinds = text["layer_types"]
    k = text["full_attention_interval"]
    assert kinds == ["full_attention" if (i + 1) % k == 0 else "linear_attention"
                     for i in range(len(kinds))], (k, kinds)  # fmt: skip
    for key, value in DEFAULTED.items():
        assert text.get(key, value) == value, key


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
