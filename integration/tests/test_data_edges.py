"""The data's last edges, against the plain case they must equal: a folder of ragged JSON Lines
files reads as the same files one by one (row for row, per-file line numbers); media as
``data:`` URLs, OpenAI ``image_url`` parts or ``base64`` keys encode exactly as the file they
hold; a byte-order mark is skipped; a line that is not UTF-8 is one bad row; ``save_to_disk``
folders load (a DatasetDict's split). Every fault is one bad row naming ``FILE:LINE`` — never
a whole-file abort or a traceback."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from helpers import ONE_PROCESS
from test_row_formats import FIELDS

from qwen35_trainer.cli import main
from qwen35_trainer.data.conversation import DataError
from qwen35_trainer.data.rows import open_rows

IMAGE = "images/000001.png"


def _ask(image: dict) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [image, {"type": "text", "text": "colour?"}]},
            {"role": "assistant", "content": "red"},
        ]
    }


def _write_jsonl(path: Path, rows: list, prefix: str = "") -> Path:
    path.write_text(prefix + "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


TOOLS = [{"type": "function", "function": {"name": "count", "parameters": {}}}]
PLAIN = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}


def test_a_folder_of_ragged_jsonl_files_reads_as_its_files_one_by_one(tmp_path):
    """The first row has ``tools`` and the later ones not (through ``datasets``' folder loader
    that was a ``KeyError``): the folder's rows are the files' rows in path order, each named
    by its own file and line."""
    folder = tmp_path / "rows"
    folder.mkdir()
    first = _write_jsonl(folder / "a.jsonl", [{"tools": TOOLS, **PLAIN}, PLAIN])
    second = _write_jsonl(folder / "b.jsonl", [PLAIN, {"messages": PLAIN["messages"] * 2}])
    rows = open_rows(str(folder))
    singles = [open_rows(str(first)), open_rows(str(second))]
    want = [(f.row(i), f.name(i)) for f in singles for i in range(len(f))]
    assert [(rows.row(i), rows.name(i)) for i in range(len(rows))] == want
    assert rows.name(2) == f"{second}:1" and rows.base_of(2) == folder
    split = tmp_path / "splits"
    split.mkdir()
    _write_jsonl(split / "train.jsonl", [PLAIN])
    _write_jsonl(split / "test.jsonl", [PLAIN, PLAIN])
    assert len(open_rows(str(split))) == 1 and len(open_rows(str(split), "test")) == 2
    with pytest.raises(DataError, match=r"has no 'validation' files .*\['test', 'train'\]"):
        open_rows(str(split), "validation")


def test_save_to_disk_folders_load(tmp_path):
    import datasets

    rows = [PLAIN, {"messages": PLAIN["messages"] * 2}]
    data = datasets.Dataset.from_list([{"messages": json.dumps(r["messages"])} for r in rows])
    data.save_to_disk(str(tmp_path / "one"))
    assert len(open_rows(str(tmp_path / "one"))) == 2
    datasets.DatasetDict({"train": data, "held": data.select([0])}).save_to_disk(
        str(tmp_path / "dict")
    )
    assert len(open_rows(str(tmp_path / "dict"))) == 2
    assert len(open_rows(str(tmp_path / "dict"), "held")) == 1
    with pytest.raises(DataError, match=r"no split 'test' .*\['held', 'train'\]"):
        open_rows(str(tmp_path / "dict"), "test")


def test_a_byte_order_mark_is_skipped(tmp_path):
    lines = _write_jsonl(tmp_path / "bom.jsonl", [PLAIN, PLAIN], prefix="\ufeff")
    assert open_rows(str(lines)).row(0) == PLAIN
    array = tmp_path / "bom.json"
    array.write_text("\ufeff" + json.dumps([PLAIN]), encoding="utf-8")
    assert open_rows(str(array)).row(0) == PLAIN


def test_embedded_media_encode_as_their_file(demo, encoder):
    """A ``data:`` URL under ``image`` or ``path``, OpenAI's ``image_url`` part (a dict or a
    string) and a ``base64`` key give exactly the encoding of the file they hold."""
    payload = base64.b64encode((demo / IMAGE).read_bytes()).decode()
    url = f"data:image/png;base64,{payload}"
    want = encoder(_ask({"type": "image", "path": IMAGE}), "row", demo)
    for part in (
        {"type": "image", "image": url},
        {"type": "image", "path": url},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": url},
        {"type": "image", "base64": payload},
    ):
        got = encoder(_ask(part), "row", demo)
        for field in FIELDS:
            assert torch.equal(getattr(got, field), getattr(want, field)), (part["type"], field)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image", "image": "data:image/png;base64,@@@@"}, r"base64 is invalid"),
        ({"type": "image", "base64": "not base64!"}, r"'base64' is not base64 data"),
        ({"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}, r"remote 'image_url'"),
        ({"type": "image", "path": "x" * 300_000}, r"not a usable file path .*300000 characters"),
    ],
)
def test_bad_embedded_media_are_bad_rows(demo, encoder, part, message):
    with pytest.raises(DataError, match=message) as error:
        encoder(_ask(part), "rows.jsonl:3", demo)
    assert str(error.value).startswith("rows.jsonl:3") and len(str(error.value)) < 400


def test_data_check_lists_bad_embedded_rows_and_training_skips_them(
    demo, tmp_path, capsys, monkeypatch
):
    """A file with a good row, a row whose data URL is broken and one whose name is 300,000
    characters: ``data check`` reports the two bad rows by ``FILE:LINE`` (exit 3), training
    with ``on_bad_row: skip`` trains on the good one."""
    payload = base64.b64encode((demo / IMAGE).read_bytes()).decode()
    rows = [
        _ask({"type": "image", "image": f"data:image/png;base64,{payload}"}),
        _ask({"type": "image", "image": "data:image/png;base64,@@"}),
        _ask({"type": "image", "path": "y" * 300_000}),
    ]
    path = _write_jsonl(tmp_path / "embedded.jsonl", rows)
    monkeypatch.chdir(tmp_path)  # the run folder
    sets = [*ONE_PROCESS, f"data.path={path}", f"data.processor={demo / 'processor'}",
            "data.eval_path=null", "train.eval_every=0"]  # fmt: skip
    args = [a for s in sets for a in ("--set", s)]
    assert main(["data", "check", "tiny", *args]) == 3
    out = capsys.readouterr()
    assert f"{path}:2" in out.out + out.err and f"{path}:3" in out.out + out.err
    assert "Traceback" not in out.err and len(out.out + out.err) < 20_000
    skip = [*args, "--set", "data.on_bad_row=skip", "--set", "train.steps=1"]
    assert main(["tiny", *skip]) == 0


def test_a_line_that_is_not_utf8_is_one_bad_row(demo, tmp_path, capsys, monkeypatch):
    """A Latin-1 byte on one line (between CRLF lines, after a blank one): that row is a bad row
    naming ``FILE:LINE``, the byte and its column; the file's other rows read — one holding
    U+FFFD itself is no bad row — ``data check`` lists it (exit 3) and training skips it."""
    good = json.dumps(PLAIN).encode()
    odd = json.dumps(
        {"messages": [PLAIN["messages"][0], {"role": "assistant", "content": "\ufffd"}]},
        ensure_ascii=False,  # U+FFFD's own bytes on the line
    )
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b"\r\n".join([good, b"", bad, odd.encode(), good]) + b"\n")
    assert "\ufffd".encode() in path.read_bytes()
    rows = open_rows(str(path))
    assert len(rows) == 4 and [rows.name(i) for i in (1, 2)] == [f"{path}:3", f"{path}:4"]
    assert rows.row(0) == rows.row(3) == PLAIN and rows.row(2) == json.loads(odd)
    with pytest.raises(DataError) as error:
        rows.row(1)
    assert str(error.value) == (
        f"{path}:3: not UTF-8: byte 0xe9 at column 47 (save the file as UTF-8)"
    )
    monkeypatch.chdir(tmp_path)  # the run folder
    sets = [*ONE_PROCESS, f"data.path={path}", f"data.processor={demo / 'processor'}",
            "data.eval_path=null", "train.eval_every=0"]  # fmt: skip
    args = [a for s in sets for a in ("--set", s)]
    assert main(["data", "check", "tiny", *args]) == 3
    out = capsys.readouterr().out
    assert "samples     3 good, 1 bad" in out, out
    assert f"bad row     {path}:3: not UTF-8: byte 0xe9 at column 47" in out, out
    skip = [*args, "--set", "data.on_bad_row=skip", "--set", "train.steps=1"]
    assert main(["tiny", *skip]) == 0
