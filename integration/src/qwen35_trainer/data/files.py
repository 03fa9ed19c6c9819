"""A dataset file as rows, each read on its own, so rows need not share a schema (a folder, or
either: :func:`qwen35_trainer.data.rows.open_rows`).

Conversation datasets are heterogeneous: one row has ``tools`` or ``images``, the next has not;
one turn's ``content`` is a string, the next a list of parts. Reading such a file into one
Arrow table infers a schema from its first rows and fails (or fills ``None`` for keys a row
never had), so JSON is parsed row by row here:

- ``.jsonl`` (and a ``.json`` file that does not start with ``[``): one JSON object per line,
  blank lines skipped (and a leading UTF-8 byte-order mark, as Windows editors save it). The
  lines are read with Hugging Face ``datasets``' ``text`` builder (memory-mapped Arrow, one
  cached copy shared by every process that reads the file) and each is parsed when it is read.
  A row is named ``FILE:LINE`` (1-based, as editors count). A line that is not UTF-8 is one bad
  row, not a file that cannot be read: the builder decodes with ``errors="replace"``, which
  turns each invalid byte sequence into U+FFFD and never swallows the ASCII ``\\n`` / ``\\r``
  that end lines, so the lines and their numbers are the bytes' own. A line holding U+FFFD is
  then looked up in the file's bytes (:func:`line_starts`, built once, only when such a line
  is read): invalid there, the row is a ``DataError`` naming the byte and its column; valid
  (the text holds U+FFFD itself), it is parsed as any row.
- ``.json`` starting with ``[``: a JSON array of row objects, parsed whole (every reading
  process holds it in memory: prefer JSON Lines for large datasets). A row is ``FILE row I``.
- ``.parquet``, a ``save_to_disk`` folder or a folder ``datasets`` can load (``data.split``;
  a folder of JSON files is read file by file, :mod:`qwen35_trainer.data.rows`): Arrow with
  the file's own schema. Rows are read as Arrow stores them, media undecoded (``datasets``' ``Image`` /
  ``Video`` columns give ``{"bytes", "path"}``), so a bad picture is a bad row, not an
  exception inside ``datasets``. A row is ``FILE row I`` (0-based).

Every fault — a missing file, an unknown extension, a file with no rows, invalid JSON or a
line that is not UTF-8 (with its line and column), a row that is not an object — is a
:class:`~qwen35_trainer.data.batch.DataError` naming the file and, for a row, the row.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from qwen35_trainer.data.batch import DataError

__all__ = ["BOM", "RowFile", "arrow_rows", "line_starts", "open_file"]

_SUFFIXES = (".jsonl", ".json", ".parquet")
BOM = "\ufeff"
REPLACED = "\ufffd"  # what errors="replace" puts for an invalid byte sequence
_CHUNK = 1 << 22  # bytes scanned at a time for line ends


class RowFile:
    """The rows of one dataset file: ``len(rows)``, ``rows.row(i)`` (a dict; ``DataError``
    naming the row when it is not one), ``rows.name(i)`` and ``rows.base_of(i)``: the folder
    relative media paths of row ``i`` are resolved against (its file's own folder, or the
    dataset folder)."""

    def __init__(self, path: Path, base: Path) -> None:
        self.path, self.base = path, base

    def __len__(self) -> int:
        raise NotImplementedError

    def name(self, i: int) -> str:
        return f"{self.path} row {i}"

    def base_of(self, i: int) -> Path:
        return self.base

    def _raw(self, i: int) -> Any:
        raise NotImplementedError

    def row(self, i: int) -> dict:
        value = self._raw(i)
        if not isinstance(value, dict):
            raise DataError(
                f"{self.name(i)}: expected a JSON object (one conversation), "
                f"got {type(value).__name__} {value!r:.60}"
            )
        return value


class _JsonLines(RowFile):
    def __init__(self, path: Path) -> None:
        import datasets
        import pyarrow.compute as pc

        super().__init__(path, path.parent)
        features = datasets.Features({"text": datasets.Value("string")})
        try:
            lines = datasets.load_dataset(
                "text",
                data_files=str(path),
                split="train",
                features=features,
                encoding_errors="replace",  # a bad line is a bad row (module docstring)
            )
        except (datasets.exceptions.DatasetGenerationError, ValueError) as error:
            raise DataError(f"data file {path} cannot be read as text lines: {error}") from error
        self._lines = lines
        column = lines.data.column("text")
        blank = pc.equal(pc.utf8_trim_whitespace(column), "")
        # row i is line _line[i] (0-based): the lines that hold something
        self._line = np.flatnonzero(~blank.to_numpy(zero_copy_only=False))
        self._starts: np.ndarray | None = None  # line_starts(path), when first needed

    def __len__(self) -> int:
        return len(self._line)

    def name(self, i: int) -> str:
        return f"{self.path}:{int(self._line[i]) + 1}"

    def _raw(self, i: int) -> Any:
        text = self._lines[int(self._line[i])]["text"]
        if i == 0:
            text = text.removeprefix(BOM)  # a file saved "with BOM" (Windows editors)
        if REPLACED in text:
            self._check_utf8(i)
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{self.name(i)}: invalid JSON ({error.msg} at column {error.colno})"
            ) from error

    def _check_utf8(self, i: int) -> None:
        """``DataError`` naming the first byte of row ``i``'s line that is not UTF-8, if any."""
        if self._starts is None:
            self._starts = line_starts(self.path)
        k = int(self._line[i])
        stop = int(self._starts[k + 1]) if k + 1 < len(self._starts) else None
        with open(self.path, "rb") as file:
            file.seek(int(self._starts[k]))
            raw = file.read(-1 if stop is None else stop - int(self._starts[k]))
        if k == 0:
            raw = raw.removeprefix(BOM.encode())
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as error:
            column = len(raw[: error.start].decode("utf-8")) + 1  # valid up to the bad byte
            raise DataError(
                f"{self.name(i)}: not UTF-8: byte 0x{raw[error.start]:02x} at column {column} "
                "(save the file as UTF-8)"
            ) from None


def line_starts(path: Path) -> np.ndarray:
    """The byte offset at which each line of ``path`` starts, lines ended as Python's text
    mode (and so ``datasets``' ``text`` builder) ends them: ``\\n``, ``\\r\\n`` or a lone
    ``\\r``. Scanned in chunks of a few MiB through a memory map (one int64 per line held)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    n, starts = len(data), [np.zeros(1, dtype=np.int64)]
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        body = np.asarray(data[lo:hi])
        after = np.asarray(data[lo + 1 : hi + 1])  # the byte after each (a \r's \n)
        if hi == n:
            after = np.append(after, np.uint8(0))
        ends = (body == 0x0A) | ((body == 0x0D) & (after != 0x0A))
        starts.append(np.flatnonzero(ends).astype(np.int64) + lo + 1)
    return np.concatenate(starts)


class _JsonArray(RowFile):
    def __init__(self, path: Path, text: str) -> None:
        super().__init__(path, path.parent)
        try:
            self._rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(
                f"data file {path}: invalid JSON ({error.msg} at line {error.lineno} column "
                f"{error.colno})"
            ) from error

    def __len__(self) -> int:
        return len(self._rows)

    def _raw(self, i: int) -> Any:
        return self._rows[i]


def _media_undecoded(feature: Any) -> Any:
    """``feature`` with every media feature (``Image``, ``Video``, ``Audio``, …: a ``decode``
    flag, ``Json`` aside) set not to decode, at any depth."""
    import datasets

    if isinstance(feature, dict):
        return datasets.Features({k: _media_undecoded(v) for k, v in feature.items()})
    if isinstance(feature, list):
        return [_media_undecoded(v) for v in feature]
    if isinstance(feature, (datasets.List, datasets.LargeList)):
        return dataclasses.replace(feature, feature=_media_undecoded(feature.feature))
    if hasattr(feature, "decode") and not isinstance(feature, datasets.Json):
        return dataclasses.replace(feature, decode=False)
    return feature


class _Arrow(RowFile):
    def __init__(self, path: Path, base: Path, table: Any) -> None:
        super().__init__(path, base)
        self._table = table.with_format("arrow")
        # decoded as the file's features say (Json columns parsed), media left as stored
        self._features = _media_undecoded(table.features)

    def __len__(self) -> int:
        return len(self._table)

    def _raw(self, i: int) -> Any:
        return self._features.decode_example(self._table[i].to_pylist()[0])


def _first_byte(path: Path) -> bytes:
    """The file's first byte that is not whitespace or a UTF-8 byte-order mark (``b""``:
    none)."""
    with open(path, "rb") as file:
        first = True
        while chunk := file.read(4096):
            if first:
                chunk, first = chunk.removeprefix(BOM.encode()), False
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1]
    return b""


def arrow_rows(
    path: Path, base: Path, table: Any = None, *, split: str = "train", subset: str | None = None
) -> RowFile:
    """The rows of an Arrow ``table`` (a ``datasets.Dataset``), or of what ``datasets`` loads
    from ``path`` — a Parquet file, or a folder (its ``subset`` and ``split``); media paths
    relative to ``base``."""
    import datasets

    if table is None:
        try:
            if path.is_dir():
                table = datasets.load_dataset(str(path), name=subset, split=split)
            else:
                table = datasets.load_dataset("parquet", data_files=str(path), split="train")
        except (datasets.exceptions.DatasetGenerationError, ValueError) as error:
            raise DataError(f"data file {path} cannot be read: {error}") from error
    return _Arrow(path, base, table)


def open_file(file: Path) -> RowFile:
    """The rows of one JSONL / JSON / Parquet file (module docstring)."""
    if file.suffix == ".parquet":
        return arrow_rows(file, file.parent)
    if file.suffix not in _SUFFIXES:
        raise DataError(f"data file {file}: expected .jsonl, .json or .parquet, or a folder")
    if not _first_byte(file):
        raise DataError(f"data file {file} has no rows (it is empty)")
    if file.suffix == ".json" and _first_byte(file) == b"[":
        try:
            text = file.read_text(encoding="utf-8-sig")  # a byte-order mark skipped
        except UnicodeDecodeError as error:
            raise DataError(f"data file {file} is not UTF-8 text: {error}") from error
        return _JsonArray(file, text)
    return _JsonLines(file)
