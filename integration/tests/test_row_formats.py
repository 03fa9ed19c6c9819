"""Every row format the ecosystem's datasets come in encodes exactly as the same conversation
written as messages rows with file paths: the same token ids, labels, M-RoPE positions, pixel
values and grids. The reference is the messages row through the encoder; each format is built
here from that conversation by hand, the way its own tools write it (Hub / TRL rows stored by
``datasets`` with embedded images, LLaMA-Factory's ``<image>`` markers, ShareGPT, Alpaca,
transformers' ``image`` / ``video`` keys). Media lists that disagree with their placeholders,
and every other fault, are bad rows naming the row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qwen35_trainer import build_config
from qwen35_trainer.data.conversation import DataError
from qwen35_trainer.data.rows import open_rows

FRAMES = [f"videos/000000/frame_{k}.png" for k in range(4)]
FIELDS = (
    "input_ids",
    "labels",
    "mm_token_type_ids",
    "position_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
)


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _reference(video: dict) -> dict:
    """The conversation as messages with file paths: a system prompt, an image question, a
    video question (``video``: its part)."""
    return {
        "messages": [
            {"role": "system", "content": "You describe pictures."},
            {
                "role": "user",
                "content": [{"type": "image", "path": "images/000001.png"}, _text("colour?")],
            },
            {"role": "assistant", "content": "red"},
            {"role": "user", "content": [video, _text("where does it go?")]},
            {"role": "assistant", "content": "down"},
        ]
    }


FRAME_VIDEO = {"type": "video", "path": FRAMES, "fps": 2}
FILE_VIDEO = {"type": "video", "path": "four.mp4"}


def _assert_same(got, want) -> None:
    for field in FIELDS:
        a, b = getattr(got, field), getattr(want, field)
        assert a.shape == b.shape and torch.equal(a, b), field
    assert (want.labels >= 0).sum() > 0 and want.pixel_values.numel()
    assert want.pixel_values_videos.numel()


def _lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _encode_file(encoder, path: Path, i: int = 0):
    rows = open_rows(str(path))
    return encoder(rows.row(i), rows.name(i), rows.base)


def test_transformers_keys_equal_path_parts(demo, encoder):
    want = encoder(_reference(FRAME_VIDEO), "ref", demo)
    row = _reference({"type": "video", "video": FRAMES, "fps": 2})
    row["messages"][1]["content"][0] = {"type": "image", "image": "images/000001.png"}
    _assert_same(encoder(row, "keys", demo), want)


def test_hub_rows_with_embedded_images_equal_path_parts(demo, encoder, tmp_path):
    """A Parquet file written by ``datasets`` as Hub datasets hold it: an ``images`` column of
    the Image feature (the picture's bytes embedded), a ``videos`` column, ``{"type":
    "image"}`` placeholders (``datasets`` adds ``null`` keys to every part), and a second row
    without ``images`` in the same file."""
    import datasets

    want = encoder(_reference(FRAME_VIDEO), "ref", demo)
    placeholders = _reference({"type": "video"})
    placeholders["messages"][1]["content"][0] = {"type": "image"}
    for turn in placeholders["messages"]:  # Parquet content is one type: parts everywhere
        if isinstance(turn["content"], str):
            turn["content"] = [_text(turn["content"])]
    png = (demo / "images" / "000001.png").read_bytes()
    text_only = {
        "messages": [
            {"role": "user", "content": [_text("up?")]},
            {"role": "assistant", "content": [_text("down")]},
        ]
    }
    table = datasets.Dataset.from_list(
        [
            {**placeholders, "images": [{"bytes": png, "path": None}], "videos": [FRAMES]},
            {**text_only, "images": [], "videos": []},
        ],
        features=datasets.Features(
            {
                "messages": datasets.List(
                    {
                        "role": datasets.Value("string"),
                        "content": datasets.List(
                            {"type": datasets.Value("string"), "text": datasets.Value("string")}
                        ),
                    }
                ),
                "images": datasets.List(datasets.Image()),
                "videos": datasets.List(datasets.List(datasets.Value("string"))),
            }
        ),
    )
    table.to_parquet(str(demo / "hub.parquet"))
    rows = open_rows(str(demo / "hub.parquet"))
    assert rows.row(0)["messages"][1]["content"][0] == {"type": "image", "text": None}
    assert rows.row(0)["images"][0]["bytes"] == png  # undecoded: a bad picture is a bad row
    _assert_same(_encode_file(encoder, demo / "hub.parquet"), want)
    assert _encode_file(encoder, demo / "hub.parquet", 1).pixel_values.numel() == 0


def test_llama_factory_rows_equal_path_parts(demo, encoder, tmp_path):
    """``<image>`` / ``<video>`` markers in string contents with top-level ``images`` /
    ``videos`` lists, as a messages row, a ShareGPT row (``conversations``, ``from`` /
    ``value``, a top-level ``system``) and in a JSON array file."""
    want = encoder(_reference(FRAME_VIDEO), "ref", demo)
    media = {"images": ["images/000001.png"], "videos": [FRAMES]}
    messages = {
        "messages": [
            {"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": "<image>colour?"},
            {"role": "assistant", "content": "red"},
            {"role": "user", "content": "<video>where does it go?"},
            {"role": "assistant", "content": "down"},
        ],
        **media,
    }
    sharegpt = {
        "system": "You describe pictures.",
        "conversations": [
            {"from": "human", "value": "<image>colour?"},
            {"from": "gpt", "value": "red"},
            {"from": "human", "value": "<video>where does it go?"},
            {"from": "gpt", "value": "down"},
        ],
        **media,
    }
    (demo / "lf.json").write_text(json.dumps([messages, sharegpt], indent=1))
    for i in range(2):
        _assert_same(_encode_file(encoder, demo / "lf.json", i), want)


def test_embedded_video_file_and_trl_prompt_completion(demo, encoder):
    want = encoder(_reference(FILE_VIDEO), "ref", demo)
    trl = {
        "prompt": [
            {"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": [{"type": "image"}, _text("colour?")]},
            {"role": "assistant", "content": "red"},
            {"role": "user", "content": [{"type": "video"}, _text("where does it go?")]},
        ],
        "completion": [{"role": "assistant", "content": "down"}],
        "images": ["images/000001.png"],
        "videos": [{"bytes": (demo / "four.mp4").read_bytes(), "path": None}],
    }
    _assert_same(encoder(trl, "trl", demo), want)


def test_alpaca_rows_equal_messages(demo, encoder):
    want = encoder(
        {
            "messages": [
                {"role": "system", "content": "You describe pictures."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "path": "images/000001.png"},
                        _text("colour?\nbe brief"),
                    ],
                },
                {"role": "assistant", "content": "red"},
            ]
        },
        "ref",
        demo,
    )
    alpaca = {
        "system": "You describe pictures.",
        "history": [["hi", "hello"]],
        "instruction": "<image>colour?",
        "input": "be brief",
        "output": "red",
        "images": ["images/000001.png"],
    }
    got = encoder(alpaca, "alpaca", demo)
    for field in FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), field


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {
                "messages": [
                    {"role": "user", "content": "<image><image>colour?"},
                    {"role": "assistant", "content": "red"},
                ],
                "images": ["images/000001.png"],
            },
            r"rows.jsonl:3: 2 image placeholder\(s\) \(2 '<image>' marker\(s\) in the text, 0 "
            r"\{'type': 'image'\} part\(s\) without a source\) for 1 image\(s\) under 'images'",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, _text("colour?")]},
                    {"role": "assistant", "content": "red"},
                ]
            },
            r"1 image placeholder\(s\) .* for 0 image\(s\) under 'images'",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "what is <video>?"},
                    {"role": "assistant", "content": "a tag"},
                ]
            },
            r"1 video placeholder\(s\) \(1 '<video>' marker\(s\).* for 0 video\(s\)",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "index": 1}, _text("?")]},
                    {"role": "assistant", "content": "red"},
                ],
                "images": ["images/000001.png"],
            },
            r"says index 1, but it is image placeholder 0 in order of appearance",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "url": "https://x/y.png"}]},
                    {"role": "assistant", "content": "red"},
                ]
            },
            r"remote 'url' \(https://x/y.png\): nothing is downloaded at run time",
        ),
        (
            {"conversations": [{"from": "robot", "value": "hi"}]},
            r"conversations\[0\] 'from' must be one of",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "conversations": [{"from": "human", "value": "hi"}],
            },
            r"exactly one of 'messages'.*the row has \['messages', 'conversations'\]",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": {"bytes": b"not a png", "path": None}}
                        ],
                    },
                    {"role": "assistant", "content": "red"},
                ]
            },
            r"unreadable image .*\(embedded, 9 bytes\)",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "video", "path": FRAMES, "fps": "two"}]},
                    {"role": "assistant", "content": "left"},
                ]
            },
            r"\(video\) 'fps' must be a number > 0, got 'two'",
        ),
    ],
    ids=[
        "two_markers_one_image",
        "placeholder_no_list",
        "literal_marker",
        "index",
        "url",
        "sharegpt_role",
        "two_forms",
        "bad_bytes",
        "bad_fps",
    ],
)
def test_bad_rows_name_the_row_and_both_counts(demo, encoder, row, message):
    with pytest.raises(DataError, match=message):
        encoder(row, "rows.jsonl:3", demo)


def test_rows_are_read_one_at_a_time(tmp_path):
    """Rows need not share keys or types (the first row's optional keys are not required of
    the next); blank lines are not rows; every fault names the file and line."""
    rows = [
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [{"role": "user", "content": "a"}],
        },
        {"messages": [{"role": "user", "content": [_text("b")]}]},
        {"messages": [{"role": "user", "content": "c"}], "images": []},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        json.dumps(rows[0])
        + "\n\n"
        + json.dumps(rows[1])
        + "\n  \n"
        + json.dumps(rows[2])
        + "\n{oops\n[1]\n"
    )
    read = open_rows(str(path))
    assert [read.row(i) for i in range(3)] == rows
    assert [read.name(i) for i in range(5)] == [f"{path}:{n}" for n in (1, 3, 5, 6, 7)]
    with pytest.raises(DataError, match=rf"{path}:6: invalid JSON \(Expecting property name"):
        read.row(3)
    with pytest.raises(DataError, match=rf"{path}:7: expected a JSON object .*got list"):
        read.row(4)
    for name, text, message in [
        ("empty.jsonl", "", "has no rows"),
        ("blank.jsonl", "\n \n", "has no rows"),
        ("broken.json", '[{"messages": []},\n{', r"invalid JSON \(.* at line 2 column 2\)"),
    ]:
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=rf"data file {tmp_path / name}.*{message}"):
            open_rows(str(tmp_path / name))


def test_the_readmes_rows_load_in_every_order(tmp_path):
    """The README's rows for a checkpoint directory (``tools`` only on one of them, ``content``
    a string in some turns and a list in others) in all 6 orders: ``data check`` reads every
    row good with Qwen3.5's template (with a file read into one Arrow table, the order with the
    ``tools`` row first failed with a ``KeyError``)."""
    import itertools

    from chat_fixtures import MODEL, QWEN35_TEMPLATE, byte_processor
    from helpers import ONE_PROCESS

    from qwen35_trainer import load_recipe
    from qwen35_trainer.data.check import check_dataset
    from qwen35_trainer.demo.dataset import ensure_demo

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    rows = readme.split("```jsonl\n")[1].split("```", 1)[0].splitlines()
    assert any('"tools"' in row for row in rows)
    demo = ensure_demo()
    processor = byte_processor(tmp_path / "processor", QWEN35_TEMPLATE, demo / "processor")
    for media in ("images", "videos"):  # the rows' media paths, beside the files written here
        (tmp_path / media).symlink_to(demo / media)
    sets = [*ONE_PROCESS, *MODEL, f"data.processor={processor}", "data.pack_length=2048"]
    for k, order in enumerate(itertools.permutations(rows)):
        path = tmp_path / f"rows_{k}.jsonl"
        path.write_text("\n".join(order) + "\n")
        recipe = load_recipe("tiny", [*sets, f"data.path={path}"])
        report = check_dataset(recipe, build_config(recipe.model))
        assert (report.samples, report.bad_rows) == (3, []), order


def _tiny_cli(path: Path, *sets: str) -> list[str]:
    from helpers import ONE_PROCESS

    demo = path.parent
    items = [
        *ONE_PROCESS,
        f"data.path={path}",
        f"data.processor={demo}/processor",
        "data.eval_path=null",
        "train.eval_every=0",
        "train.steps=1",
        f"train.output_dir={demo / 'runs' / path.stem}",
        *sets,
    ]
    return ["tiny", *(a for item in items for a in ("--set", item))]


def test_data_faults_exit_2_with_one_message_naming_file_and_line(demo, capsys):
    """Training on an empty file, a file with an invalid JSON line, a row whose markers
    disagree with its images: exit 2, one message naming the file and line, no traceback; the
    same invalid line through ``data check``: listed once (exit 3)."""
    from qwen35_trainer.cli import main

    good = json.dumps(
        {"messages": [{"role": "user", "content": "up?"}, {"role": "assistant", "content": "down"}]}
    )
    marker = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "<image><image>?"},
                {"role": "assistant", "content": "red"},
            ],
            "images": ["images/000001.png"],
        }
    )
    cases = [
        ("", "has no rows (it is empty)", None),
        (f"{good}\n{good[:-3]}\n", "invalid JSON (Expecting ',' delimiter at column", 2),
        (f"{good}\n\n{marker}\n", "2 image placeholder(s)", 3),
    ]
    for k, (text, message, line) in enumerate(cases):
        path = demo / f"fault_{k}.jsonl"
        path.write_text(text)
        assert main(_tiny_cli(path)) == 2, message
        err = capsys.readouterr().err
        where = f"{path}:{line}: " if line else f"data file {path} "
        assert err.count("qwen35-train:") == 1 and where + message in err, err
        assert "Traceback" not in err, err
    assert main(["data", "check", *_tiny_cli(demo / "fault_1.jsonl")]) == 3
    out, err = capsys.readouterr()
    assert (out + err).count(f"{demo / 'fault_1.jsonl'}:2: invalid JSON") == 1, out + err
