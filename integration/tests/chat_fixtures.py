"""Test builders for real checkpoint directories: a byte-level tokenizer (every text decodes
back exactly, so labels can be checked by decoding them) with the Qwen3.5 special tokens, a
processor directory around it with a given chat template, and a transformers checkpoint
directory written by ``save_pretrained`` with that processor beside it."""

from __future__ import annotations

import shutil
from pathlib import Path

QWEN35_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_5_chat_template.jinja").read_text()

# A ChatML template without thinking: every turn is <|im_start|>role\n content <|im_end|>\n.
CHATML_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.content is string -%}{{- m.content -}}"
    "{%- else -%}{%- for p in m.content or [] -%}"
    "{%- if p.type == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif p.type == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- else -%}{{- p.text -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- for c in m.tool_calls or [] -%}{{- '<tool_call>' + c.function.name + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Byte tokens 0..255, then the specials (the recipe's token ids follow from them).
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
IDS = {token: 256 + k for k, token in enumerate(SPECIALS)}
MODEL = (
    "model.text.vocab_size=272",
    f"model.text.pad_token_id={IDS['<|endoftext|>']}",
    f"model.image_token_id={IDS['<|image_pad|>']}",
    f"model.video_token_id={IDS['<|video_pad|>']}",
    f"model.vision_start_token_id={IDS['<|vision_start|>']}",
    f"model.vision_end_token_id={IDS['<|vision_end|>']}",
)


def byte_processor(folder: Path, template: str, demo_processor: Path) -> Path:
    """A processor directory: a byte-level BPE tokenizer (no merges) with :data:`SPECIALS`,
    ``template`` as its chat template, and the demo's small image and video processors."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    folder.mkdir(parents=True, exist_ok=True)
    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIALS))
    assert [tokenizer.token_to_id(t) for t in SPECIALS] == list(IDS.values())
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(template)
    for name in (
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "processor_config.json",
        "tokenizer_config.json",
    ):
        shutil.copy(demo_processor / name, folder / name)
    return folder


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's byte-to-unicode map)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


def checkpoint_dir(folder: Path, demo_processor: Path, template: str = QWEN35_TEMPLATE) -> Path:
    """A transformers checkpoint directory as people have one: a small Qwen3.5 MoE-VLM (the
    tiny recipe's shapes on the byte vocabulary) written by transformers' own
    ``save_pretrained``, with a processor and ``template`` saved beside it."""
    import torch
    from transformers import Qwen3_5MoeForConditionalGeneration

    from qwen35_trainer import load_recipe
    from qwen35_trainer.model import build_config

    config = build_config(load_recipe("tiny", list(MODEL)).model)
    torch.manual_seed(0)
    Qwen3_5MoeForConditionalGeneration(config).save_pretrained(folder)
    return byte_processor(folder, template, demo_processor)
