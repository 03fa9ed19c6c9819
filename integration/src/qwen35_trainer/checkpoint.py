"""Save and resume training with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is the directory ``<checkpoint_dir>/step_<NNNNNN>`` holding the model and optimizer
state (``torch.distributed.checkpoint.state_dict``: FSDP2 / EP DTensor shards are written by
their owners and re-sharded on load, so a checkpoint can be resumed under another layout) and the
number of finished steps.

Atomic: every rank writes into ``step_<NNNNNN>.partial``; after all ranks finished (a barrier),
rank 0 renames it to ``step_<NNNNNN>``, and only such names with DCP's ``.metadata`` count. A
crash mid-save leaves a ``.partial`` directory that is ignored (and replaced by the next save of
that step), so the previous checkpoint stays the newest loadable one. ``keep`` > 0 deletes all
but the newest ``keep`` complete checkpoints after each save. :class:`AsyncCheckpointer` writes
in the background and completes each checkpoint the same way, later.

Loading runs no foreign code: DCP's ``.metadata`` is a pickle and its non-tensor items are
``torch.load`` ed with ``weights_only=False``. Here the metadata is read by an unpickler that
allows only the classes DCP itself writes there (:data:`METADATA_GLOBALS`), and every non-tensor
item must load with ``weights_only=True`` before DCP reads it; anything else is refused with the
file and the name it asked for.

Why a resumed run continues exactly: the model and optimizer tensors are restored bit for bit,
the data stream is a pure function of the step index (:mod:`qwen35_trainer.data`), and nothing
else in a step is random (the model has no dropout; the expert dispatch is deterministic).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = [
    "METADATA_GLOBALS",
    "AsyncCheckpointer",
    "UnsafeCheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "save_checkpoint",
]

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


_UNSAFE_ITEM = "holds more than plain data"


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


class _SafeReader(FileSystemReader):
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


class _SafePlanner(DefaultLoadPlanner):
    """Non-tensor items must load with ``weights_only=True`` before DCP reads them."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"checkpoint item {read_item.dest_index.fqn!r} {_UNSAFE_ITEM}: {err}"
            ) from err
        value.seek(0)
        super().load_bytes(read_item, value)


_STEP_DIR = re.compile(r"^step_(\d{6,})$")


@contextlib.contextmanager
def _one_process_is_intended():
    """DCP warns that it assumes a single process when no group exists; here that is the case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def latest_checkpoint(checkpoint_dir: str | Path) -> tuple[Path, int] | None:
    """The newest complete checkpoint under ``checkpoint_dir`` and its step, or ``None``."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), path)
        for path in root.iterdir()
        if (m := _STEP_DIR.match(path.name)) and (path / ".metadata").is_file()
    ]
    if not found:
        return None
    step, path = max(found)
    return path, step


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _begin(checkpoint_dir: str | Path, step: int) -> tuple[Path, Path, Path]:
    """``(root, final path, .partial path)`` of the checkpoint after ``step``, a stale
    ``.partial`` removed; every rank returns once it is gone."""
    root = Path(checkpoint_dir)
    path = root / f"step_{step:06d}"
    partial = root / f"{path.name}.partial"
    if (not dist.is_initialized() or dist.get_rank() == 0) and partial.exists():
        shutil.rmtree(partial)  # left by a crash mid-save
    _barrier()
    return root, path, partial


def _finish(root: Path, path: Path, partial: Path, keep: int, files: dict[str, str] | None):
    """After every rank wrote its shards into ``partial``: rank 0 adds ``files``, renames it to
    ``path`` and prunes to the newest ``keep``; every rank returns once that is done."""
    _barrier()  # every rank's shards are written
    if not dist.is_initialized() or dist.get_rank() == 0:
        for name, text in (files or {}).items():
            (partial / name).write_text(text)
        if path.exists():
            shutil.rmtree(path)
        partial.rename(path)
        if keep > 0:
            done = sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name))
            for old in done[:-keep]:
                shutil.rmtree(old)
    _barrier()  # every rank sees the checkpoint before it goes on


def _state(step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}


def save_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    keep: int = 0,
    files: dict[str, str] | None = None,
) -> Path:
    """Write the state after ``step`` finished steps (every rank calls this); atomic, see the
    module docstring. ``keep`` > 0: keep only the newest ``keep`` checkpoints. ``files``: text
    files rank 0 adds to the checkpoint (e.g. the resolved recipe), name -> content."""
    root, path, partial = _begin(checkpoint_dir, step)
    with _one_process_is_intended():
        dcp.save(_state(step, model, optimizer), checkpoint_id=str(partial),
                 no_dist=not dist.is_initialized())  # fmt: skip
    _finish(root, path, partial, keep, files)
    return path


class AsyncCheckpointer:
    """:func:`save_checkpoint` with the writing in a background thread: ``save`` copies the
    state to host memory (DCP's stager) and returns, so training goes on while the shards are
    written; the checkpoint is completed (the same rename as the synchronous save, so it is
    just as atomic) by the next ``save`` or by :meth:`wait`, which every rank must call before
    the run ends. Its collectives run on a gloo group of its own, never concurrently with the
    training's on the default group."""

    def __init__(self) -> None:
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._group = dist.new_group(backend="gloo") if distributed else None
        self._pending = None
        if not dist.is_initialized():  # the writer thread repeats DCP's one-process notice
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

    def save(self, checkpoint_dir: str | Path, step: int, model: nn.Module,
             optimizer: torch.optim.Optimizer, *, keep: int = 0,
             files: dict[str, str] | None = None) -> Path:  # fmt: skip
        self.wait()
        root, path, partial = _begin(checkpoint_dir, step)
        with _one_process_is_intended():
            future = dcp.async_save(_state(step, model, optimizer), checkpoint_id=str(partial),
                                    process_group=self._group,
                                    no_dist=not dist.is_initialized())  # fmt: skip
        self._pending = (future, root, path, partial, keep, files)
        return path

    def wait(self) -> None:
        """Complete the checkpoint being written, if any (every rank)."""
        if self._pending is None:
            return
        future, *rest = self._pending
        self._pending = None
        future.result()
        _finish(*rest)


def _read(path: str | Path, state: dict, what: str, *, partial: bool = False) -> None:
    """``state`` filled in place from the DCP checkpoint at ``path`` (checked first: safe
    metadata, weights-only items); ``partial``: only the items ``state`` names."""
    _SafeReader(str(path)).read_metadata()  # refuses a crafted file before DCP wraps the error
    try:
        with _one_process_is_intended():
            dcp.load(state, storage_reader=_SafeReader(str(path)),
                     planner=_SafePlanner(allow_partial_load=partial),
                     no_dist=not dist.is_initialized())  # fmt: skip
    except (Exception, CheckpointException) as err:  # DCP's wraps each rank's failure
        reason = str(err).strip().splitlines()[-1]  # the wrapped error's own line
        if _UNSAFE_ITEM in str(err):
            raise UnsafeCheckpointError(f"{path}: {reason}") from err
        raise ValueError(
            f"checkpoint {path} cannot be loaded into this {what} (a checkpoint of another "
            f"model shape or optimizer?): {reason}"
        ) from err


def load_model_weights(path: str | Path, model: nn.Module) -> int:
    """Restore only ``model``'s weights from the checkpoint at ``path`` (any layout: DCP
    re-shards); returns its finished steps."""
    state = {"model": get_model_state_dict(model), "step": torch.tensor(0)}
    _read(path, state, "model", partial=True)
    set_model_state_dict(model, state["model"])
    return int(state["step"])


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore ``model`` and ``optimizer`` in place from ``path``; returns the finished steps."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
    _read(path, state, "model and optimizer")
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(state["step"])
