"""The ``config.json`` fields inference servers read that transformers leaves implicit.

transformers' Qwen3.5 MoE computes with two things its config need not state: the split of the
rotary dims between M-RoPE's temporal, height and width positions (``rope_parameters.
mrope_section``; ``[11, 11, 10]`` when the config has none), always interleaved (there is no
switch), and the layer kinds, from ``layer_types``. The servers read them from ``config.json``
and fall back to defaults of their own that differ:

- vLLM (its ``get_rope``) builds M-RoPE only when ``rope_parameters`` holds ``mrope_section``,
  and interleaves only when ``mrope_interleaved`` is true: without them the tokens of a picture
  get plain 1-D positions, not the ones the model was trained with;
- SGLang (its Qwen3-Next config's ``layers_block_type``) takes the layer kinds from
  ``full_attention_interval`` (every k-th layer full attention), not from ``layer_types``.

So :func:`complete_for_servers` writes ``rope_parameters.mrope_section`` as the model's own
rotary embedding holds it (the value it trained with), ``mrope_interleaved: true`` and
``full_attention_interval``, the period of ``layer_types``. A model whose layer kinds have no
period (not one full-attention layer every k) gets none, and the note says SGLang cannot
describe it. transformers reads the completed config back to the same model: it ignores
``full_attention_interval`` when ``layer_types`` is given, and the M-RoPE keys state its defaults.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["attention_period", "complete_for_servers"]


def attention_period(layer_types: list[str]) -> int | None:
    """``k`` when layer ``i`` is ``full_attention`` exactly when ``(i + 1) % k == 0`` (and every
    other layer ``linear_attention``), else ``None``."""
    for k in range(1, len(layer_types) + 1):
        kinds = ["full_attention" if (i + 1) % k == 0 else "linear_attention"
                 for i in range(len(layer_types))]  # fmt: skip
        if kinds == list(layer_types):
            return k
    return None


def complete_for_servers(config: Any, model: nn.Module) -> list[str]:
    """Add to ``config`` (a copy of the model's ``Qwen3_5MoeConfig``, about to be saved) the
    fields of the module docstring; ``model``: the model it describes (its rotary embedding
    gives the M-RoPE split). Returns notes on what could not be stated."""
    text = config.text_config
    rope = dict(text.rope_parameters or {})
    if "mrope_section" not in rope:
        held = next((m.mrope_section for m in model.modules() if hasattr(m, "mrope_section")), None)
        if held is not None:
            rope["mrope_section"] = list(held)
    rope.setdefault("mrope_interleaved", True)
    text.rope_parameters = rope
    period = attention_period(list(text.layer_types))
    if period is None:
        return [
            "no full_attention_interval in config.json: the layer kinds "
            f"{list(text.layer_types)} are not one full-attention layer every k, which SGLang "
            "(full_attention_interval) cannot describe"
        ]
    text.full_attention_interval = period
    return []
