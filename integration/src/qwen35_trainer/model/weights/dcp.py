"""A torch Distributed Checkpoint (DCP) folder of model state as a weight source's files.

DCP-based trainers keep their weights as a folder written by ``torch.distributed.checkpoint.
save`` (a ``.metadata`` file and ``*.distcp`` files): the state dict of a transformers model
(``model.state_dict()``: the runtime names, the experts stacked), or this trainer's own training
checkpoint (``step_<NNNNNN>``: the model's state under ``model.model.``, beside ``optim.*``
and ``step``). :class:`DcpFiles` offers the folder as :class:`~qwen35_trainer.model.weights.files.
CheckpointFiles` offers safetensors — ``where``, ``shape``, ``dtype`` (safetensors' dtype names)
and ``rows(key, lo, hi)`` — so :class:`~qwen35_trainer.model.weights.load.CheckpointSource`
plans, checks and reads it like any other checkpoint, and every layout reads what one process
reads.

What a rank reads: the metadata lists each tensor's stored chunks (one per rank that saved
it); ``rows`` asks DCP's own reader for the chunk list ``[lo:hi, :]`` only
(:func:`torch.distributed.checkpoint.planner_helpers.create_read_items_for_chunk_list`), so it
reads the stored chunks that overlap those rows and no other (a folder saved by N ranks: the
chunks of the rows this rank holds; saved by one process: the tensor, one at a time), and copies
just the rows out. No collective: each rank reads on its own, at its own pace.

A training checkpoint is recognised by its ``step`` entry (a transformers state dict has no
tensor of that name); its ``optim.*`` entries are not weights and are not listed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = ["DcpFiles", "is_dcp_folder"]

METADATA = ".metadata"
# a training checkpoint's model state: train/checkpoint.py saves the objective's state under
# "model", and the objective holds the model as its ``model``
_TRAINING_STATE = "model.model."
_STEP = "step"
# torch dtype -> the safetensors name the checks speak (model/weights/stored.py)
_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def is_dcp_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder ``torch.distributed.checkpoint.save`` wrote."""
    return (Path(path) / METADATA).is_file()


class DcpFiles:
    """The tensors of the DCP folder ``path`` (module docstring); ``window_bytes`` is
    accepted for the safetensors reader's signature (a DCP chunk is read and released per
    call)."""

    def __init__(self, path: str | Path, *, window_bytes: int | None = None) -> None:
        del window_bytes
        self.path = Path(path)
        self._reader = FileSystemReader(str(self.path))
        try:
            metadata = self._reader.read_metadata()
        except Exception as err:  # a truncated or foreign .metadata: torch's errors vary
            raise ValueError(
                f"model.weights: {self.path / METADATA} cannot be read: {err}"
            ) from err
        self._reader.set_up_storage_reader(metadata, True)
        entries = metadata.state_dict_metadata
        prefix = _TRAINING_STATE if _STEP in entries else ""
        self._stored: dict[str, tuple[str, TensorStorageMetadata]] = {
            fqn.removeprefix(prefix): (fqn, md)
            for fqn, md in entries.items()
            if isinstance(md, TensorStorageMetadata) and fqn.startswith(prefix)
        }
        if not self._stored:
            raise ValueError(f"model.weights: no tensor of model state in {self.path}")
        first: dict[str, str] = {}  # each tensor's first stored chunk's file, in one pass
        for index, info in (metadata.storage_data or {}).items():
            first.setdefault(index.fqn, info.relative_path)
        self.where = {key: first.get(fqn, METADATA) for key, (fqn, _) in self._stored.items()}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._stored[key][1].size)

    def dtype(self, key: str) -> str:
        """Tensor ``key``'s dtype by its safetensors name (``BF16``, ``F8_E4M3``, ...)."""
        dtype = self._stored[key][1].properties.dtype
        return _NAMES.get(dtype, str(dtype).removeprefix("torch."))

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of tensor ``key`` (dim 0), as stored."""
        fqn, md = self._stored[key]
        size = tuple(md.size)
        shape = (max(hi - lo, 0), *size[1:]) if size else ()  # a scalar: its one chunk
        rows = torch.empty(shape, dtype=md.properties.dtype)
        offsets = torch.Size([lo, *(0 for _ in size[1:])] if size else [])
        wanted = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(shape))
        items = create_read_items_for_chunk_list(fqn, md, [wanted])
        if items:
            self._reader.read_data(LoadPlan(items), _Into(rows)).wait()
        return rows


class _Into(LoadPlanner):
    """DCP's reader writes each read item into its span of ``rows`` (the item's destination
    offsets are relative to the chunk asked for)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def set_up_planner(self, *args, **kwargs) -> None:
        raise NotImplementedError("used only to receive reads")

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError("used only to receive reads")

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError("used only to receive reads")

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError("used only to receive reads")

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise ValueError(f"{read_item.dest_index.fqn}: bytes where a tensor was expected")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        span = self.rows
        for dim, (offset, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            span = span.narrow(dim, offset, length)
        return span

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """The reader copied into :meth:`resolve_tensor`'s view: nothing left to do."""
