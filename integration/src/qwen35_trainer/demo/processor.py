"""The demo dataset's processor directory (:mod:`qwen35_trainer.demo.dataset`): a byte-level BPE
tokenizer trained with ``tokenizers`` on the dataset's rendered text — with Qwen3.5's text
pipeline, so transformers' ``Qwen3_5Tokenizer`` splits it the same (:func:`_qwen_pipeline`) —
the Qwen3.5 special tokens at the ids the tiny recipe names (:data:`SPECIAL_TOKENS`), a chat
template, and Qwen3.5's image and video processor configs with small sizes (patch 2, merge 2,
16×16 pixels, fps 2, at most 8 frames)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "CHAT_TEMPLATE",
    "IMAGE_SIZE",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TEXT_VOCAB",
    "write_json",
    "write_processor",
]

IMAGE_SIZE = 16  # pixels: 8×8 patches of 2, 16 merged tokens
TEXT_VOCAB = 120  # learned tokens: ids 0 .. 119; the specials follow
# The Qwen3.5 special tokens, in id order from TEXT_VOCAB (image 120, video 121, vision start 122,
# vision end 123: the tiny recipe's model.*_token_id).
SPECIAL_TOKENS = (
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|im_start|>",
    "<|im_end|>",
)
PAD_TOKEN = "<|endoftext|>"  # id 0

# Renders messages as Qwen3.5 does (<|im_start|>role\n ... <|im_end|>\n), each image or video part
# as one placeholder between vision markers; the processor expands the placeholders.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- else -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _corpus(rows: list[dict]) -> list[str]:
    """The text the tokenizer is trained on: every rendered conversation (placeholders out) and
    the video timestamps the processor writes."""
    from jinja2 import Template

    template = Template(CHAT_TEMPLATE)
    texts = []
    for row in rows:
        text = template.render(messages=row["messages"], add_generation_prompt=False)
        for token in SPECIAL_TOKENS:
            text = text.replace(token, " ")
        texts.append(text)
    texts += [f"<{t / 2:.1f} seconds>" for t in range(0, 40)]
    return texts


def _qwen_pipeline(tokenizer) -> None:
    """Give ``tokenizer`` Qwen3.5's text pipeline — NFC, its pre-tokenisation split, byte-level
    symbols — which transformers' ``Qwen3_5Tokenizer`` rebuilds around any vocabulary it loads
    (it does whenever a Qwen3.5 ``config.json`` sits beside the tokenizer, whatever class the
    tokenizer names): the demo's text then splits the same under either class."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()


def write_processor(folder: Path, rows: list[dict]) -> None:
    """Write the processor directory (module docstring) into ``folder``, its tokenizer
    trained on ``rows``' text."""
    from tokenizers import Tokenizer, models, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    _qwen_pipeline(tokenizer)
    corpus = _corpus(rows)
    # the byte-level symbols the corpus uses (all 256 would not leave room for merges)
    alphabet = sorted(
        {c for text in corpus for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)
         for c in piece}
    )  # fmt: skip
    trainer = trainers.BpeTrainer(
        vocab_size=TEXT_VOCAB,
        special_tokens=[PAD_TOKEN],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    filler = [f"<|reserved_{k}|>" for k in range(TEXT_VOCAB - tokenizer.get_vocab_size())]
    tokenizer.add_special_tokens(filler + list(SPECIAL_TOKENS))
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != list(range(TEXT_VOCAB, TEXT_VOCAB + len(SPECIAL_TOKENS))):
        raise RuntimeError(f"demo tokenizer: special token ids {ids} are not the recipe's")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "TokenizersBackend",
            "pad_token": PAD_TOKEN,
            "eos_token": "<|im_end|>",
            "model_max_length": 131072,
            "extra_special_tokens": {
                "image_token": "<|image_pad|>",
                "video_token": "<|video_pad|>",
                "vision_start_token": "<|vision_start|>",
                "vision_end_token": "<|vision_end|>",
            },
        },
    )
    sizes = {
        "patch_size": 2,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    pixels = IMAGE_SIZE * IMAGE_SIZE
    write_json(
        folder / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3VLProcessor",
            "size": {"shortest_edge": pixels // 4, "longest_edge": pixels},
            **sizes,
        },
    )
    write_json(
        folder / "video_preprocessor_config.json",
        {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "processor_class": "Qwen3VLProcessor",
            "size": {"shortest_edge": pixels // 4, "longest_edge": pixels * 8},
            "fps": 2,
            "min_frames": 2,
            "max_frames": 8,
            "do_sample_frames": True,
            "cap_pixels_per_frame": True,
            **sizes,
        },
    )
    write_json(folder / "processor_config.json", {"processor_class": "Qwen3VLProcessor"})


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
