"""Video as the checkpoint's processor expects it — frames sampled from the file's own frame
rate and duration, the prompt's per-frame timestamps those of the frames actually sampled
(read back from the pixels) — and ``data check`` reporting the frames sampled and the packed
rows and fill the run's loader packs (against an independent packing of the same documents)."""

from __future__ import annotations

import re

import av
import numpy as np
import pytest
import torch
from chat_fixtures import MODEL, QWEN35_TEMPLATE, byte_processor
from helpers import ONE_PROCESS, demo_recipe

from qwen35_trainer import load_recipe
from qwen35_trainer.cli import main
from qwen35_trainer.data.conversation import ConversationEncoder
from qwen35_trainer.data.loader import truncate
from qwen35_trainer.demo.dataset import make_demo
from qwen35_trainer.model import build_config

FPS, FRAMES, STEP = 4, 8, 30  # frame k is solid red 30 k


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("demo"), train_rows=40, heldout_rows=4)


def _write_video(path):
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=FPS)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "1"}
        for k in range(FRAMES):
            rgb = np.zeros((32, 32, 3), dtype=np.uint8)
            rgb[..., 0] = STEP * k
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _sampled(encoder, sample):
    """``(frame indices read from the pixels, per temporal patch; timestamps in the prompt)``."""
    t, h, w = sample.video_grid_thw[0].tolist()
    vision = encoder.config.vision_config
    patch, temporal = vision.patch_size, vision.temporal_patch_size
    rows = sample.pixel_values_videos.view(t, h * w, 3, temporal, patch, patch)
    red = (rows[:, :, 0].mean(dim=(1, 3, 4)) * 0.5 + 0.5) * 255  # [t, temporal]
    frames = (red / STEP).round().long().tolist()
    text = encoder.processor.tokenizer.decode(sample.input_ids.tolist())
    stamps = [float(x) for x in re.findall(r"<([0-9.]+) seconds>", text)]
    return frames, stamps


@pytest.mark.parametrize(("video_fps", "expected"), [(None, 4), (4.0, 8)])
def test_timestamps_are_those_of_the_frames_sampled(demo, tmp_path, video_fps, expected):
    _write_video(tmp_path / "clip.mp4")
    processor = byte_processor(tmp_path / "processor", QWEN35_TEMPLATE, demo / "processor")
    sets = [*ONE_PROCESS, *MODEL, f"data.processor={processor}"]
    if video_fps:
        sets.append(f"data.video_fps={video_fps}")
    recipe = load_recipe("tiny", sets)
    encoder = ConversationEncoder.from_recipe(recipe.data, recipe.model, build_config(recipe.model))
    row = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video", "path": "clip.mp4"},
                    {"type": "text", "text": "what changes?"},
                ],
            },
            {"role": "assistant", "content": "red"},
        ]
    }
    frames, stamps = _sampled(encoder, encoder(row, "rows.jsonl:0", tmp_path))
    # the file is 2 s at 4 fps: the processor's 2 fps take 4 frames, data.video_fps=4 all 8
    assert sum(len(pair) for pair in frames) == expected
    flat = [k for pair in frames for k in pair]
    assert flat == sorted(flat) and flat[0] == 0 and flat[-1] == FRAMES - 1
    # each temporal patch's stamp is the mean time of its frames, as the prompt says
    assert stamps == [float(f"{(a / FPS + b / FPS) / 2:.1f}") for a, b in frames]


def _pack(lengths: list[int], shards: int, capacity: int) -> tuple[int, int]:
    """``(rows, tokens)``: documents dealt by position to ``shards`` shards, each shard's rows
    filled in order until its next document does not fit (written here from the stated rule)."""
    rows = tokens = 0
    for s in range(shards):
        room = None
        for n in lengths[s::shards]:
            if room is None or n > room:
                rows, room = rows + 1, capacity
            room -= n
            tokens += n
    return rows, tokens


def test_data_check_reports_the_loaders_rows_and_fill(demo, capsys):
    sets = ["data.global_batch=4", "data.pack_length=96", "data.shuffle=false"]
    recipe = demo_recipe(demo, *sets)
    encoder = ConversationEncoder.from_recipe(recipe.data, recipe.model, build_config(recipe.model))
    import json

    config = build_config(recipe.model)
    lengths = []
    for k, line in enumerate((demo / "train.jsonl").read_text().splitlines()):
        doc = encoder(json.loads(line), f"train.jsonl:{k}", demo)
        lengths.append(len(doc) if len(doc) <= 96 else len(truncate(doc, 96, config)))
    rows, tokens = _pack(lengths, 4, 96)
    args = [f"data.path={demo}/train.jsonl", f"data.processor={demo}/processor", *sets]
    capsys.readouterr()
    assert main(["data", "check", "tiny", *(a for s in args for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert f"packed rows {rows} of 96 tokens, fill {tokens / (rows * 96):.3f}" in out, out
    assert "samples     40 good, 0 bad" in out
    videos = re.search(r"(\d+) videos \((\d+)-(\d+) frames sampled\)", out)
    assert videos and int(videos.group(1)) > 0 and int(videos.group(2)) >= 2, out
    assert torch.tensor(lengths).sum() == tokens
