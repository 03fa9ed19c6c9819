"""A checkpoint folder's safetensors files, read by row spans.

:class:`CheckpointFiles` lists every tensor of the folder's ``*.safetensors`` files (the index,
when there is one, says which file holds which; a file the index names that is missing is an
error) from their headers alone, and reads rows ``lo:hi`` of one tensor at a time through the
safetensors library (no pickle; ``safe_open(...).get_slice``), so a rank never reads more than
its shard's dim-0 span of one tensor, and nothing of a tensor it does not hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["MAPPED_WINDOW_BYTES", "CheckpointFiles", "folder_problem", "open_files"]


# Bytes read through one open file before it is closed and reopened: safetensors maps the file
# into memory, and the pages read stay in this process's RSS until the mapping goes.
MAPPED_WINDOW_BYTES = 1 << 30


class CheckpointFiles:
    """The tensors of a checkpoint directory's ``*.safetensors`` files (the index, when there
    is one, says which file holds which tensor). At most ``window_bytes`` read from a file stay
    mapped: then it is reopened, so host memory holds the shards read plus one window."""

    def __init__(self, path: str | Path, *, window_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.window_bytes = MAPPED_WINDOW_BYTES if window_bytes is None else window_bytes
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model.weights: no *.safetensors file in {self.path}")
        self._handles: dict[str, object] = {}
        self._read: dict[str, int] = {}
        self.where: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for name in files:
            if not (self.path / name).is_file():
                raise ValueError(f"model.weights: {index} names {name}, which is not there")
            handle = self._open(name)
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                self.where[key] = name
                tensor = handle.get_slice(key)
                self._shapes[key] = tuple(tensor.get_shape())
                self._dtypes[key] = tensor.get_dtype()
            self._handles.pop(name)

    def _open(self, name: str):
        from safetensors import safe_open

        if name not in self._handles:
            self._handles[name] = safe_open(str(self.path / name), framework="pt")
            self._read[name] = 0
        return self._handles[name]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def dtype(self, key: str) -> str:
        """Tensor ``key``'s safetensors dtype name (``BF16``, ``F8_E4M3``, ``I64``, ...)."""
        return self._dtypes[key]

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of tensor ``key`` (dim 0), as stored: a view of the file's mapping,
        which stays valid (mapped) while the view lives, even after the file is reopened."""
        name = self.where[key]
        rows = self._open(name).get_slice(key)[lo:hi]
        self._read[name] += rows.numel() * rows.element_size()
        if self._read[name] >= self.window_bytes:
            del self._handles[name]  # unmaps the pages read so far
        return rows


def open_files(path: str | Path, *, window_bytes: int | None = None):
    """The tensors of weight folder ``path``, by its kind: a torch Distributed Checkpoint
    folder (:class:`~qwen35_trainer.model.weights.dcp.DcpFiles`), else safetensors
    (:class:`CheckpointFiles`). Both offer ``where``, ``shape``, ``dtype`` and ``rows``."""
    from qwen35_trainer.model.weights.dcp import DcpFiles, is_dcp_folder

    kind = DcpFiles if is_dcp_folder(path) else CheckpointFiles
    return kind(path, window_bytes=window_bytes)


def folder_problem(path: str | Path) -> str | None:
    """Why ``model.weights`` folder ``path`` (its config given by the recipe) holds no
    weights this trainer reads, or ``None``: a transformers folder (its ``config.json``) or a
    torch Distributed Checkpoint folder (its ``.metadata``)."""
    from qwen35_trainer.model.weights.dcp import is_dcp_folder

    folder = Path(path)
    if (folder / "config.json").is_file() or is_dcp_folder(folder):
        return None
    return (
        f"model.weights: {str(path)!r} is neither a transformers checkpoint directory (no "
        "config.json there) nor a torch Distributed Checkpoint folder (no .metadata there)"
    )
