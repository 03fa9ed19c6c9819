"""Checkpoint integrity: a manifest of every file a checkpoint holds (size and checksum),
written while saving, and the verdict on a checkpoint directory when it is loaded or checked.

A checkpoint directory (:mod:`qwen35_trainer.train.checkpoint`) is written by every rank (its DCP
shard files), by DCP's coordinator (``.metadata``) and by rank 0 (the recipe, the data state).
Each writer computes the checksum of a file from the bytes it hands to the file, as it writes
them (:class:`ChecksummingWriter` wraps DCP's file streams; :func:`write_file` for the text
files): nothing is read back. Rank 0 gathers every rank's records and writes them as
``manifest.json``, the LAST file, just before the atomic rename; so a checkpoint whose name is
final and which has a manifest was complete when it was renamed, and any later change to its
bytes (a truncated copy, a flipped bit, a missing file) is found by :func:`find_problems`.

Why the checksum is right for the file: every byte of a file goes through exactly one
``write`` of its stream, in order (DCP writes each file from one thread, appending; nothing
seeks back), so hashing each written buffer in turn hashes the file's bytes; the size recorded
is the stream's position at close, which is the file's length.

The checksum is XXH3-64 (xxhash): it detects accidental damage (it is not a signature against
deliberate tampering; loading stays guarded by the allow-list unpickler), at several GiB/s per
core, so it costs a few per cent of a save (``benchmarks/bench_checkpoint.py``).

Verifying a checkpoint (:func:`verify`): sizes are compared for every file (a ``stat`` each);
checksums read the files again. Under a launch, ``share`` lets each rank hash every
``world``-th file; the ranks then combine their verdicts
(:func:`qwen35_trainer.train.resume.agreed_verdict`). A directory is one of:

- ``intact``: it has a manifest and every file matches it;
- ``damaged``: a file is missing, has another size or checksum, the manifest cannot be read, or
  a final-named directory has neither a manifest nor DCP's ``.metadata``;
- ``incomplete``: a ``step_N.partial`` directory (a save that did not finish; never loaded);
- ``no manifest``: written before manifests existed (DCP's ``.metadata`` present): it loads,
  unverified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = [
    "ALGORITHM",
    "DAMAGED",
    "INCOMPLETE",
    "INTACT",
    "MANIFEST",
    "NO_MANIFEST",
    "ChecksummingWriter",
    "FileRecord",
    "Verdict",
    "find_problems",
    "read_manifest",
    "verify",
    "verify_all",
    "write_file",
    "write_manifest",
]

MANIFEST = "manifest.json"
ALGORITHM = "xxh3_64"
FORMAT = 1
_READ_BYTES = 8 * 2**20


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint: its size in bytes and the hex checksum of its bytes."""

    size: int
    checksum: str


class _HashingStream:
    """A binary file opened for writing whose written bytes are hashed on their way in (in the
    writing thread: handing large buffers to a second thread measured slower, 1.22x against
    1.04x the plain write on tmpfs, than hashing them here at ~9 GiB/s)."""

    def __init__(self, file, on_close) -> None:
        self._file, self._on_close = file, on_close
        self._hash = xxhash.xxh3_64()

    def write(self, data) -> int:
        self._hash.update(data)
        return self._file.write(data)

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self._file.closed:
            return
        size = self._file.tell()
        self._file.close()
        self._on_close(FileRecord(size, self._hash.hexdigest()))


class _RecordingFileSystem(FileSystem):
    """DCP's local file system; files opened for writing are recorded by name when closed,
    and a rename (DCP writes ``.metadata`` under a temporary name) carries the record along."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, FileRecord] = {}
        self._lock = threading.Lock()

    def _record(self, name: str, record: FileRecord) -> None:
        with self._lock:
            self.records[name] = record

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        stream = _HashingStream(open(path, mode), lambda r: self._record(path.name, r))  # noqa: SIM115
        try:
            yield stream
        finally:
            stream.close()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.records:
                self.records[Path(new_path).name] = self.records.pop(Path(path).name)


class ChecksummingWriter(FileSystemWriter):
    """DCP's :class:`~torch.distributed.checkpoint.FileSystemWriter` that records the size and
    checksum of every file it writes (``records``: name -> :class:`FileRecord`), computed while
    writing. Each rank writes ``thread_count`` files (2) from as many threads, so one thread's
    hashing (memory-bound, ~9 GiB/s) overlaps the other's disk I/O."""

    def __init__(self, path: str | os.PathLike, *, thread_count: int = 2) -> None:
        super().__init__(path, thread_count=thread_count)
        self.fs = _RecordingFileSystem()

    @property
    def records(self) -> dict[str, FileRecord]:
        return dict(self.fs.records)


def write_file(path: Path, data: bytes) -> FileRecord:
    """Write ``data`` to ``path`` and return its record. Not fsync'd (DCP syncs the shards): a
    crash that loses these small files after the rename leaves a checkpoint that the manifest
    check calls damaged, and resume falls back past it."""
    path.write_bytes(data)
    return FileRecord(len(data), xxhash.xxh3_64(data).hexdigest())


def write_manifest(directory: Path, records: dict[str, FileRecord]) -> None:
    """``directory/manifest.json`` listing ``records`` (written last)."""
    body = {
        "format": FORMAT,
        "checksum": ALGORITHM,
        "files": {name: dataclasses.asdict(records[name]) for name in sorted(records)},
    }
    write_file(directory / MANIFEST, (json.dumps(body, indent=1) + "\n").encode())


def read_manifest(directory: Path) -> dict[str, FileRecord] | None:
    """The manifest's records, ``None`` when the directory has no manifest (a checkpoint
    written before manifests existed); ``ValueError`` when it cannot be read."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_bytes())
        if body.get("format") != FORMAT or body.get("checksum") != ALGORITHM:
            raise ValueError(
                f"format {body.get('format')!r} / checksum {body.get('checksum')!r}, "
                f"expected {FORMAT} / {ALGORITHM!r}"
            )
        return {
            name: FileRecord(int(r["size"]), str(r["checksum"]))
            for name, r in body["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{MANIFEST} cannot be read ({type(err).__name__}: {err})") from err


def _checksum(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as file:
        while chunk := file.read(_READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def find_problems(
    directory: Path,
    records: dict[str, FileRecord],
    *,
    checksums: bool = True,
    share: tuple[int, int] = (0, 1),
) -> list[str]:
    """What differs between ``directory`` and its manifest ``records``: one line per missing
    file, wrong size or (``checksums``) wrong checksum. ``share = (rank, world)``: this caller
    hashes only every ``world``-th file of the manifest, starting at ``rank`` (sizes are
    checked for every file)."""
    problems = []
    rank, world = share
    for index, name in enumerate(sorted(records)):
        expected, path = records[name], directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name}: missing (expected {expected.size} bytes)")
            continue
        if size != expected.size:
            problems.append(f"{name}: expected {expected.size} bytes, found {size}")
        elif checksums and index % world == rank:
            found = _checksum(path)
            if found != expected.checksum:
                problems.append(
                    f"{name}: checksum {found}, expected {expected.checksum} "
                    f"({ALGORITHM} of its {size} bytes)"
                )
    return problems


INTACT, DAMAGED, INCOMPLETE, NO_MANIFEST = "intact", "damaged", "incomplete", "no manifest"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a checkpoint directory is (``state``: one of the module docstring's four) and,
    when damaged, why (one line per problem)."""

    path: Path
    state: str
    problems: tuple[str, ...] = ()
    files: int = 0  # in the manifest
    size: int = 0  # their bytes

    @property
    def loadable(self) -> bool:
        return self.state in (INTACT, NO_MANIFEST)

    def describe(self) -> str:
        """``state``, with the problems after a colon."""
        return self.state + (": " + "; ".join(self.problems) if self.problems else "")


def verify(path: Path, *, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> Verdict:
    """The verdict on the checkpoint directory ``path`` (see :func:`find_problems` for
    ``checksums`` and ``share``)."""
    path = Path(path)
    if path.name.endswith(".partial"):
        return Verdict(path, INCOMPLETE, ("a save that did not finish",))
    try:
        records = read_manifest(path)
    except ValueError as err:
        return Verdict(path, DAMAGED, (str(err),))
    if records is None:
        if (path / ".metadata").is_file():
            return Verdict(path, NO_MANIFEST)
        return Verdict(path, DAMAGED, (f"neither {MANIFEST} nor DCP's .metadata",))
    problems = find_problems(path, records, checksums=checksums, share=share)
    size = sum(r.size for r in records.values())
    return Verdict(path, DAMAGED if problems else INTACT, tuple(problems), len(records), size)


_CHECKPOINT_NAME = re.compile(r"^step_\d{6,}(\.partial)?$")


def verify_all(path: Path, *, checksums: bool = True) -> list[Verdict]:
    """The verdicts on ``path`` when it is one checkpoint, else on every checkpoint directory
    under it (``step_N`` and ``step_N.partial``, oldest first); ``ValueError`` when it is
    neither."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory")
    is_one = _CHECKPOINT_NAME.match(path.name) or any(
        (path / name).exists() for name in (MANIFEST, ".metadata")
    )
    found = (
        [path] if is_one else sorted(p for p in path.iterdir() if _CHECKPOINT_NAME.match(p.name))
    )
    if not found:
        raise ValueError(f"{path}: neither a checkpoint nor a directory holding step_N checkpoints")
    return [verify(p, checksums=checksums) for p in found]
