"""Conversation rows through the processor: loss masking, a packed row of processor-made
documents (text only, image, videos from frame files and from a video file) against
transformers' own model run on each document alone (loss and every gradient), truncation, and
every bad-data case named by file and row."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import tiny

from dist_testkit import assert_close, assert_grads_close
from qwen35_trainer import TrainingObjective, build_config, swap_moe_blocks
from qwen35_trainer.data import IGNORE_INDEX
from qwen35_trainer.data.conversation import ConversationEncoder, DataError, TokenIds
from qwen35_trainer.data.loader import truncate
from qwen35_trainer.data.packing import pack
from qwen35_trainer.demo.dataset import _motion_frames, _write_mp4, make_demo
from qwen35_trainer.model.packed import enable_packing

IMAGE = {"type": "image", "path": "images/000001.png"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    root = make_demo(tmp_path_factory.mktemp("demo"), train_rows=24, heldout_rows=4)
    import random

    frames = _motion_frames("left", (230, 40, 40), random.Random(0))
    (root / "two").mkdir()
    for k, frame in enumerate(frames[:2]):
        frame.save(root / "two" / f"{k}.png")
    assert _write_mp4(frames, root / "four.mp4")
    return root


def _encoder(root: Path, **kwargs) -> ConversationEncoder:
    r = tiny()
    return ConversationEncoder(
        str(root / "processor"), TokenIds(120, 121, 122, 123), build_config(r.model), **kwargs
    )


def _ask(parts, answer: str, *more) -> dict:
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": answer},
            *more,
        ]
    }


def _labelled(encoder, sample) -> str:
    return encoder.processor.tokenizer.decode(sample.labels[sample.labels != IGNORE_INDEX])


def test_only_assistant_turns_are_labelled(demo):
    encoder = _encoder(demo)
    row = _ask(
        [IMAGE, {"type": "text", "text": "what colour is it?"}],
        "red",
        {"role": "user", "content": "and the shape?"},
        {"role": "assistant", "content": "square"},
    )
    sample = encoder(row, "rows.jsonl:0", demo)
    assert _labelled(encoder, sample) == "red<|im_end|>square<|im_end|>"  # the two answers
    ids = sample.input_ids
    assert (sample.labels[ids == 120] == IGNORE_INDEX).all()  # image placeholders never
    # the labels are exactly the ids where they are set
    set_ = sample.labels != IGNORE_INDEX
    assert torch.equal(sample.labels[set_], ids[set_])
    everything = _encoder(demo, train_on="all")(row, "rows.jsonl:0", demo)
    assert torch.equal(everything.input_ids, ids)
    assert torch.equal(everything.labels != IGNORE_INDEX, sample.mm_token_type_ids == 0)
    assert "what colour is it?" in _labelled(encoder, everything)


def _documents(demo):
    """Processor-made documents: text only, text + image, text + 2-frame video (frame files),
    text + 4-frame video (an mp4 file)."""
    encoder = _encoder(demo)
    rows = [
        {
            "messages": [
                {"role": "user", "content": "what is the opposite of up?"},
                {"role": "assistant", "content": "down"},
            ]
        },
        _ask([IMAGE, {"type": "text", "text": "describe the image."}], "a blue square"),
        _ask(
            [
                {"type": "video", "path": ["two/0.png", "two/1.png"], "fps": 2},
                {"type": "text", "text": "where does it go?"},
            ],
            "left",
        ),
        _ask(
            [
                {"type": "video", "path": "four.mp4"},
                {"type": "text", "text": "which way does the square move?"},
            ],
            "left",
        ),
    ]
    return [encoder(row, f"rows.jsonl:{i}", demo) for i, row in enumerate(rows)]


def test_packed_processor_documents_equal_transformers_per_document(demo):
    samples = _documents(demo)
    assert samples[2].video_grid_thw.tolist() == [[1, 8, 8]]
    assert samples[3].video_grid_thw.tolist() == [[2, 8, 8]]
    r = tiny("model.expert_backend=torch")
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(build_config(r.model))
    ours = copy.deepcopy(hf)
    swap_moe_blocks(ours, expert_backend="torch")
    enable_packing(ours)
    objective = TrainingObjective(ours)
    # the reference: every document alone through transformers (its own M-RoPE positions)
    total, counts = 0.0, []
    for s in samples:
        media = {
            k: getattr(s, k)
            for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
            if getattr(s, k).numel()
        }
        out = hf(
            input_ids=s.input_ids[None],
            mm_token_type_ids=s.mm_token_type_ids[None],
            labels=s.labels[None],
            use_cache=False,
            **media,
        )
        n = int((s.labels[1:] != IGNORE_INDEX).sum())
        counts.append(n)
        total = total + out.loss * n
    reference = total / sum(counts)
    batch, packed = pack(samples, ours.config, pad_token_id=0)
    shares = objective(batch, packed=packed)
    assert shares.tokens == sum(counts)
    assert_close(shares.ce, reference, rtol=1e-5, atol=1e-6, name="ce")
    reference.backward()
    shares.ce.backward()
    assert_grads_close(ours, hf, rtol=1e-4, atol=1e-6)
    assert ours.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0  # media were trained


def test_truncation_never_cuts_media_apart(demo):
    """A cut inside a picture or video moves before it (the media go with their
    placeholders); a cut after the media keeps them whole; positions are the prefix's."""
    encoder = _encoder(demo)
    config = build_config(tiny().model)
    for media in (IMAGE, {"type": "video", "path": "four.mp4"}):
        row = {
            "messages": [
                {"role": "user", "content": "what is the opposite of up?"},
                {"role": "assistant", "content": "down"},
                {"role": "user", "content": [media]},
                {"role": "assistant", "content": "red"},
            ]
        }
        sample = encoder(row, "rows.jsonl:0", demo)
        placeholders = (sample.mm_token_type_ids != 0).nonzero().flatten()
        first, last = int(placeholders[0]), int(placeholders[-1])
        cut = truncate(sample, first + 3, config)
        assert (
            len(cut) == first and cut.pixel_values.numel() == cut.pixel_values_videos.numel() == 0
        )
        assert not cut.image_grid_thw.numel() and not cut.video_grid_thw.numel()
        assert torch.equal(cut.input_ids, sample.input_ids[: len(cut)])
        assert torch.equal(cut.position_ids, sample.position_ids[:, : len(cut)])
        assert _labelled(encoder, cut).split() == ["down<|im_end|>"]
        kept = truncate(sample, len(sample) - 1, config)
        assert len(kept) == len(sample) - 1 > last
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            assert torch.equal(getattr(kept, key), getattr(sample, key)), key
        assert torch.equal(kept.position_ids, sample.position_ids[:, :-1])
    assert truncate(sample, 4, config) is None  # nothing trainable left


def _write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (_ask([{"type": "image", "path": "images/nope.png"}], "red"), "missing media file"),
        (
            _ask([{"type": "video", "path": ["two/0.png", "nope.png"]}], "left"),
            "missing media file",
        ),
        (_ask([{"type": "audio", "path": "x.wav"}], "red"), "unknown type 'audio'"),
        ({"messages": [{"role": "user", "content": "hello"}]}, "no trainable token"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "must have a role in"),
        ({"text": "no messages"}, "expected a conversation under exactly one of 'messages'"),
        (_ask([{"type": "image", "path": "corrupt.png"}], "red"), "unreadable image"),
        (_ask([{"type": "video", "path": "corrupt.mp4"}], "red"), "unreadable video"),
    ],
    ids=[
        "missing_image",
        "missing_frame",
        "unknown_part",
        "no_trainable_turn",
        "bad_role",
        "no_messages",
        "corrupt_image",
        "corrupt_video",
    ],
)
def test_bad_rows_raise_naming_file_and_row(demo, row, message):
    (demo / "corrupt.png").write_bytes(b"not a png")
    (demo / "corrupt.mp4").write_bytes(b"not a video")
    with pytest.raises(DataError, match=message) as raised:
        _encoder(demo)(row, "rows.jsonl:7", demo)
    assert "rows.jsonl:7" in str(raised.value)


def test_processor_that_does_not_match_the_model_is_refused(demo):
    r = tiny("model.image_token_id=119")
    encoder = ConversationEncoder(
        str(demo / "processor"), TokenIds(119, 121, 122, 123), build_config(r.model)
    )
    with pytest.raises(DataError, match=r"image token id 120 \(model.image_token_id is 119\)"):
        _ = encoder.processor
