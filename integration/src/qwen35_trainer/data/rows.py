"""A dataset as rows: :func:`open_rows` of ``data.path``, a file
(:func:`~qwen35_trainer.data.files.open_file`) or a folder, one of three kinds:

- a ``save_to_disk`` dataset (``state.json`` / ``dataset_dict.json``): ``datasets``'
  ``load_from_disk``; of a ``DatasetDict`` the split ``data.split`` (``train`` by default; one
  that is not there is an error naming the ones that are);
- a folder of JSON Lines / JSON files: each file read row by row as a single file is
  (:func:`~qwen35_trainer.data.files.open_file`: rows need not share keys, every row named
  ``FILE:LINE``), the files in path order. Files whose path names a split (``train``, ``test``,
  ``validation`` / ``valid`` / ``dev``, ``eval``, as ``datasets`` recognises them: a word of the
  path between ``-``, ``_``, ``.``, ``/``, spaces or digits) hold that split; when none does,
  every file is the ``train`` split;
- anything else ``datasets`` loads (Parquet files, a Hub dataset's folder): as it loads it.

A folder whose ``README.md`` defines ``configs`` (a Hub dataset repository, or its snapshot:
:mod:`qwen35_trainer.recipe.hub`), or any folder read with ``data.subset``, holds the files
``datasets`` gives that subset (its config ``name``; ``None``: the default one) and split
(``datasets.load_dataset_builder``): JSON ones read file by file as above, others by
``datasets.load_dataset(folder, name=subset, split=split)``.

A JSON folder is never handed to ``datasets``' folder loader: it infers one schema from the
first rows, so a later row without the first row's ``tools`` failed with a ``KeyError`` there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from qwen35_trainer.data.batch import DataError
from qwen35_trainer.data.files import RowFile, arrow_rows, open_file

__all__ = ["open_folder", "open_rows"]

# a split's words in a file's path (datasets' convention)
SPLIT_WORDS = {
    "train": ("train", "training"),
    "test": ("test", "testing", "eval", "evaluation"),
    "validation": ("validation", "valid", "val", "dev"),
}
# JSON files a dataset folder holds that are not rows
_METADATA = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}


class _Files(RowFile):
    """The rows of several files, one after the other."""

    def __init__(self, folder: Path, files: list[RowFile]) -> None:
        super().__init__(folder, folder)
        self.files = files
        self.starts = [0]
        for rows in files:
            self.starts.append(self.starts[-1] + len(rows))

    def __len__(self) -> int:
        return self.starts[-1]

    def _at(self, i: int) -> tuple[RowFile, int]:
        f = next(k for k in range(len(self.files)) if i < self.starts[k + 1])
        return self.files[f], i - self.starts[f]

    def name(self, i: int) -> str:
        rows, j = self._at(i)
        return rows.name(j)

    def base_of(self, i: int) -> Path:
        rows, j = self._at(i)
        return rows.base_of(j)

    def row(self, i: int) -> dict:
        rows, j = self._at(i)
        return rows.row(j)


def _split(relative: str) -> str | None:
    words = set(re.split(r"[-._ /0-9]+", relative.lower()))
    return next((split for split, names in SPLIT_WORDS.items() if words & set(names)), None)


def _json_files(folder: Path, split: str) -> list[Path]:
    """The folder's JSON / JSON Lines files of ``split`` (module docstring)."""
    found = sorted(
        p
        for p in folder.rglob("*")
        if p.suffix in (".jsonl", ".json") and p.name not in _METADATA and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )  # fmt: skip
    splits = {p: _split(str(p.relative_to(folder))) for p in found}
    if not any(splits.values()):
        if found and split != "train":
            raise DataError(
                f"data folder {folder}: its files name no split, so all are 'train'; "
                f"data.split={split!r}"
            )
        return found
    chosen = [p for p, s in splits.items() if s == split]
    if not chosen:
        named = sorted({s for s in splits.values() if s})
        raise DataError(f"data folder {folder} has no {split!r} files (data.split); it has {named}")
    return chosen


def _from_disk(folder: Path, split: str) -> Any:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as error:
        raise DataError(
            f"data folder {folder} cannot be read by load_from_disk: {error}"
        ) from error
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"data folder {folder} (a saved DatasetDict) has no split {split!r} "
                f"(data.split); it has {sorted(loaded)}"
            )
        loaded = loaded[split]
    return loaded


def _configured(folder: Path) -> bool:
    """Whether the folder's ``README.md`` defines ``configs`` (its files per subset)."""
    from huggingface_hub import DatasetCard

    readme = folder / "README.md"
    return readme.is_file() and bool(DatasetCard.load(readme).data.get("configs"))


def _subset_files(folder: Path, split: str, subset: str | None) -> list[Path]:
    """The files ``datasets`` reads for ``subset`` and ``split`` of the folder."""
    import datasets

    try:
        files = datasets.load_dataset_builder(str(folder), name=subset).config.data_files
    except (FileNotFoundError, ValueError) as error:
        raise DataError(f"data folder {folder} (data.subset={subset!r}): {error}") from error
    if split not in (files or {}):
        raise DataError(
            f"data folder {folder} (data.subset={subset!r}) has no split {split!r} (data.split); "
            f"it has {sorted(files or {})}"
        )
    return [Path(f) for f in files[split]]


def open_folder(folder: Path, split: str, subset: str | None = None) -> RowFile:
    """The rows of a dataset folder (module docstring), of ``subset`` when given."""
    if (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file():
        if subset is not None:
            raise DataError(
                f"data folder {folder} is a save_to_disk dataset: it has no subsets "
                f"(data.subset={subset!r})"
            )
        return arrow_rows(folder, folder, _from_disk(folder, split))
    if subset is not None or _configured(folder):
        files = _subset_files(folder, split, subset)
        if files and all(f.suffix in (".jsonl", ".json") for f in files):
            return _Files(folder, [open_file(f) for f in files])
        return arrow_rows(folder, folder, None, split=split, subset=subset)
    files = _json_files(folder, split)
    if files:
        return _Files(folder, [open_file(f) for f in files])
    return arrow_rows(folder, folder, None, split=split)


def open_rows(path: str, split: str = "train", subset: str | None = None) -> RowFile:
    """The rows of a JSONL / JSON / Parquet file (:mod:`qwen35_trainer.data.files`) or a folder
    (module docstring; its ``split`` and ``subset``); ``DataError`` when it is missing,
    unreadable or has no rows."""
    import datasets

    datasets.disable_progress_bars()
    file = Path(path)
    if not file.exists():
        raise DataError(f"data file {path} does not exist")
    if subset is not None and not file.is_dir():
        raise DataError(f"data file {path}: data.subset={subset!r} names a subset of a folder")
    rows = open_folder(file, split, subset) if file.is_dir() else open_file(file)
    if len(rows) == 0:
        raise DataError(f"data file {path} has no rows")
    return rows
