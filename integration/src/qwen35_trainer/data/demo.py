"""The built-in demo dataset: conversations about drawn shapes and moving shapes, written to disk
in the conversation format (:mod:`qwen35_trainer.data.conversation`) with a local processor
directory, so the real path — files → processor → packing → model — runs offline.

``make_demo(DIR)`` writes:

- ``train.jsonl`` / ``heldout.jsonl``: one conversation per row (``messages``), disjoint seeds;
- ``images/*.png``: a shape (circle, square, triangle) of one colour on black, or 1–3 dots;
- ``videos/NNNNNN/frame_K.png``: a square moving left, right, up or down (a frame list), and
  ``videos/NNNNNN.mp4`` for every other video when PyAV can encode one;
- ``processor/``: a byte-free BPE tokenizer trained with ``tokenizers`` on the dataset's rendered
  text, the Qwen3.5 special tokens at the ids the tiny recipe names (:data:`SPECIAL_TOKENS`), a
  chat template, and Qwen3.5's image and video processor configs with small sizes (patch 2,
  merge 2, 16×16 pixels, fps 2, at most 8 frames) — loaded by ``AutoProcessor.from_pretrained``.

Questions and answers are about colour, shape, count and direction of motion; each answer is
determined by the media, so a model that learns drops its held-out loss well below the text
prior's and answers above chance. Everything is drawn from ``random.Random(seed)``: the same call
writes the same files.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

__all__ = [
    "COLOURS",
    "DEMO_VERSION",
    "SHAPES",
    "SPECIAL_TOKENS",
    "demo_dir",
    "ensure_demo",
    "make_demo",
    "resolve",
]

DEMO_VERSION = 2
IMAGE_SIZE = 16  # pixels: 8×8 patches of 2, 16 merged tokens
COLOURS = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (60, 90, 240),
    "yellow": (240, 220, 40),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
NUMBERS = ("one", "two", "three")
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


def _draw_shape(shape: str, colour: tuple[int, int, int], rng: random.Random):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))
    draw = ImageDraw.Draw(image)
    size = rng.randint(9, 13)
    x, y = rng.randint(0, IMAGE_SIZE - size), rng.randint(0, IMAGE_SIZE - size)
    box = (x, y, x + size - 1, y + size - 1)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon(
            [(x + size // 2, y), (x, y + size - 1), (x + size - 1, y + size - 1)], fill=colour
        )
    return image


def _draw_dots(count: int, rng: random.Random):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))
    draw = ImageDraw.Draw(image)
    cells = rng.sample([(cx, cy) for cx in range(3) for cy in range(3)], count)
    for cx, cy in cells:
        x, y = 1 + cx * 5, 1 + cy * 5
        draw.rectangle((x, y, x + 3, y + 3), fill=(255, 255, 255))
    return image


def _motion_frames(
    direction: str, colour: tuple[int, int, int], rng: random.Random, frames: int = 4
) -> list:
    from PIL import Image, ImageDraw

    dx, dy = DIRECTIONS[direction]
    step, size = 3, 5
    lo, hi = step * (frames - 1), IMAGE_SIZE - size - step * (frames - 1)
    x = rng.randint(0, IMAGE_SIZE - size) if dx == 0 else (lo if dx < 0 else rng.randint(0, hi))
    y = rng.randint(0, IMAGE_SIZE - size) if dy == 0 else (lo if dy < 0 else rng.randint(0, hi))
    out = []
    for k in range(frames):
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))
        px, py = x + dx * step * k, y + dy * step * k
        ImageDraw.Draw(image).rectangle((px, py, px + size - 1, py + size - 1), fill=colour)
        out.append(image)
    return out


def _write_mp4(frames: list, path: Path, fps: int = 2) -> bool:
    """Encode ``frames`` losslessly enough for the demo (mpeg4, high quality); False without
    PyAV or an encoder."""
    try:
        import av
        import numpy as np
    except ImportError:
        return False
    try:
        with av.open(str(path), "w") as container:
            stream = container.add_stream("mpeg4", rate=fps)
            stream.width = stream.height = IMAGE_SIZE
            stream.pix_fmt = "yuv420p"
            stream.options = {"qscale": "1"}
            for frame in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame))):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    except (av.FFmpegError, ValueError):
        path.unlink(missing_ok=True)
        return False
    return True


def _user(parts: list[dict]) -> dict:
    return {"role": "user", "content": parts}


def _answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _row(root: Path, index: int, rng: random.Random) -> dict:
    """One conversation; its media written under ``root``."""
    kind = rng.choices(
        ["colour", "shape", "caption", "count", "two_turns", "video", "text"],
        weights=[20, 20, 10, 10, 10, 20, 10],
    )[0]
    name = f"{index:06d}"
    if kind == "text":
        word = rng.choice(list(DIRECTIONS))
        opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
        return {
            "messages": [
                {"role": "user", "content": f"what is the opposite of {word}?"},
                _answer(opposite[word]),
            ]
        }
    if kind == "video":
        direction = rng.choice(list(DIRECTIONS))
        colour = rng.choice(list(COLOURS))
        frames = _motion_frames(direction, COLOURS[colour], rng)
        folder = root / "videos" / name
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for k, frame in enumerate(frames):
            frame.save(folder / f"frame_{k}.png")
            paths.append(f"videos/{name}/frame_{k}.png")
        video: dict = {"type": "video", "path": paths, "fps": 2}
        if index % 2 and _write_mp4(frames, root / "videos" / f"{name}.mp4"):
            video = {"type": "video", "path": f"videos/{name}.mp4"}
        question = rng.choice(["which way does the square move?", "where does it go?"])
        return {
            "messages": [_user([video, {"type": "text", "text": question}]), _answer(direction)]
        }
    path = f"images/{name}.png"
    (root / "images").mkdir(parents=True, exist_ok=True)
    if kind == "count":
        count = rng.randint(1, 3)
        _draw_dots(count, rng).save(root / path)
        return {
            "messages": [
                _user(
                    [{"type": "image", "path": path}, {"type": "text", "text": "how many dots?"}]
                ),
                _answer(NUMBERS[count - 1]),
            ]
        }
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    _draw_shape(shape, COLOURS[colour], rng).save(root / path)
    image = {"type": "image", "path": path}
    if kind == "two_turns":
        return {
            "messages": [
                _user([image, {"type": "text", "text": "what colour is it?"}]),
                _answer(colour),
                _user([{"type": "text", "text": "and the shape?"}]),
                _answer(shape),
            ]
        }
    question, answer = {
        "colour": ("what colour is the shape?", colour),
        "shape": ("what shape is it?", shape),
        "caption": ("describe the image.", f"a {colour} {shape}"),
    }[kind]
    return {"messages": [_user([image, {"type": "text", "text": question}]), _answer(answer)]}


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


def _write_processor(folder: Path, rows: list[dict]) -> None:
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
    _json(
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
    _json(
        folder / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3VLProcessor",
            "size": {"shortest_edge": pixels // 4, "longest_edge": pixels},
            **sizes,
        },
    )
    _json(
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
    _json(folder / "processor_config.json", {"processor_class": "Qwen3VLProcessor"})


def _json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def make_demo(
    folder: str | Path, *, train_rows: int = 800, heldout_rows: int = 128, seed: int = 0
) -> Path:
    """Write the demo dataset under ``folder`` (created; existing files are overwritten) and
    return it. ``train_rows`` / ``heldout_rows``: conversations per split."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    train = [_row(root, i, rng) for i in range(train_rows)]
    heldout = [_row(root, train_rows + i, rng) for i in range(heldout_rows)]
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        with open(root / name, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    _write_processor(root / "processor", train + heldout)
    _json(
        root / "demo.json",
        {
            "version": DEMO_VERSION,
            "train_rows": train_rows,
            "heldout_rows": heldout_rows,
            "seed": seed,
        },
    )
    return root


BUILTIN = "builtin:demo"


def demo_dir() -> Path:
    """Where ``builtin:demo`` lives: ``$QWEN35_DEMO_DIR``, else a per-version folder under
    ``~/.cache/qwen35_trainer``."""
    folder = os.environ.get("QWEN35_DEMO_DIR")
    if folder:
        return Path(folder)
    return Path.home() / ".cache" / "qwen35_trainer" / f"demo-v{DEMO_VERSION}"


def ensure_demo() -> Path:
    """The demo dataset's folder, written first if missing. Safe when several processes (the
    ranks of a job) ask at once: one writes while the others wait on a file lock; it writes a
    private copy and renames it into place, so nobody ever reads a half-written folder (and on
    machines that share no lock, each writes its own identical, seeded copy)."""
    import fcntl

    folder = demo_dir()
    if (folder / "demo.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "demo.json").is_file():  # written while this process waited
            return folder
        scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            make_demo(scratch)
            scratch.rename(folder)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return folder


def resolve(path: str | None) -> str | None:
    """``builtin:demo/REST`` → the demo folder's ``REST`` (written first if missing); any other
    path unchanged."""
    if path is None or not path.startswith(BUILTIN):
        return path
    rest = path[len(BUILTIN) :].lstrip("/")
    return str(ensure_demo() / rest)
