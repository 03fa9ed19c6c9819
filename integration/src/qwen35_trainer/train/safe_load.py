"""Loading a DCP checkpoint without running foreign code.

DCP's ``.metadata`` is a pickle, and its non-tensor items are ``torch.load`` ed with
``weights_only=False``: a crafted checkpoint could run any code when it is read. Here the
metadata is read by an unpickler that allows only the classes DCP itself writes there
(:data:`METADATA_GLOBALS`), and every non-tensor item must load with ``weights_only=True``
before DCP reads it; anything else is refused with the file and the name it asked for
(:class:`UnsafeCheckpointError`).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

__all__ = ["METADATA_GLOBALS", "UNSAFE_ITEM", "SafePlanner", "SafeReader", "UnsafeCheckpointError"]

# (module, name) pairs a DCP .metadata pickle may name, besides the classes of
# torch.distributed.checkpoint.metadata and torch's dtypes.
METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


UNSAFE_ITEM = "holds more than plain data"


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks for code that a DCP checkpoint never contains."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        allowed = (module, name) in METADATA_GLOBALS
        if module == dcp_metadata.__name__:
            value = getattr(dcp_metadata, name, None)
            allowed = getattr(value, "__module__", None) == module
        elif module == "torch":
            allowed = allowed or isinstance(getattr(torch, name, None), torch.dtype)
        if not allowed:
            raise UnsafeCheckpointError(
                f"{self.path}: the checkpoint metadata asks for {module}.{name}, which a DCP "
                "checkpoint never contains; refusing to unpickle it (a crafted or foreign file?)"
            )
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file, path).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpointError(f"{path}: not DCP metadata ({type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """Non-tensor items must load with ``weights_only=True`` before DCP reads them."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"checkpoint item {read_item.dest_index.fqn!r} {UNSAFE_ITEM}: {err}"
            ) from err
        value.seek(0)
        super().load_bytes(read_item, value)
