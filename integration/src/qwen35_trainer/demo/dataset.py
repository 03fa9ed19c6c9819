"""The built-in demo dataset: conversations about drawn shapes and moving shapes, written to disk
in the conversation format (:mod:`qwen35_trainer.data.conversation`) with a local processor
directory, so the real path — files → processor → packing → model — runs offline.

``make_demo(DIR)`` writes:

- ``train.jsonl`` / ``heldout.jsonl``: one conversation per row (``messages``), disjoint seeds;
- ``images/*.png``: a shape (circle, square, triangle) of one colour on black, or 1–3 dots;
- ``videos/NNNNNN/frame_K.png``: a square moving left, right, up or down (a frame list), and
  ``videos/NNNNNN.mp4`` for every other video when PyAV can encode one;
- ``processor/``: the tokenizer, chat template and image / video processor configs
  (:mod:`qwen35_trainer.demo.processor`) — loaded by ``AutoProcessor.from_pretrained``.

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

from qwen35_trainer.demo.processor import (
    IMAGE_SIZE,
    SPECIAL_TOKENS,
    write_json,
    write_processor,
)

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
COLOURS = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (60, 90, 240),
    "yellow": (240, 220, 40),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
NUMBERS = ("one", "two", "three")


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
    write_processor(root / "processor", train + heldout)
    write_json(
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


def resolve(path: str) -> str:
    """``builtin:demo/REST`` → the demo folder's ``REST`` (written first if missing);
    ``ValueError`` for a ``builtin:`` path that names no built-in input."""
    if path != BUILTIN and not path.startswith(f"{BUILTIN}/"):
        raise ValueError(
            f"{path!r} names no built-in input (the built-in one is the demo dataset, "
            f"{BUILTIN}/...)"
        )
    return str(ensure_demo() / path[len(BUILTIN) :].lstrip("/"))
