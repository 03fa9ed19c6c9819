"""Save training state with ``torch.distributed.checkpoint`` (DCP); :mod:`qwen35_trainer.train.
resume` finds, checks and loads it.

A checkpoint is the directory ``<checkpoint_dir>/step_<NNNNNN>`` holding the model and optimizer
state (``torch.distributed.checkpoint.state_dict``: FSDP2 / EP DTensor shards are written by
their owners and re-sharded on load, so a checkpoint can be resumed under another layout;
megatron-fsdp's uneven shards with their true offsets, :func:`fsdp_compat.dcp_ready`, so its
checkpoints resume on FSDP2 and back), the
number of finished steps, the files the trainer adds (the resolved recipe, the data state) and
``manifest.json``: every file's size and checksum (:mod:`qwen35_trainer.train.integrity`).

Atomic: every rank writes into ``step_<NNNNNN>.partial``, checksumming its files as it writes
them; rank 0 gathers the records (which also waits for every rank to finish), adds the trainer's
files, writes the manifest last and renames the directory to ``step_<NNNNNN>``. A crash
mid-save leaves a ``.partial`` directory that is never loaded (and is replaced by the next save
of that step). ``keep`` > 0 deletes all but the newest ``keep`` checkpoints after each save.
:class:`AsyncCheckpointer` writes in the background and completes each checkpoint the same way,
later.
"""

from __future__ import annotations

import functools
import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from qwen35_trainer.data.feed import Feed
from qwen35_trainer.parallel.dist import all_ranks, rank
from qwen35_trainer.train.integrity import ChecksummingWriter, write_file, write_manifest
from qwen35_trainer.train.resume import (
    DATA_STATE,
    checkpoints_in,
    one_process_is_intended,
    sharded_state,
)

__all__ = ["AsyncCheckpointer", "data_state_files", "save_checkpoint"]


def data_state_files(feed: Feed) -> dict[str, str]:
    """``{data_state.json: the feed's state}`` for :func:`save_checkpoint`'s ``files`` (every
    rank calls it: one all-reduce), or ``{}`` for the synthetic stream."""
    state = feed.state_dict()
    return {} if state is None else {DATA_STATE: json.dumps(state)}


def _begin(checkpoint_dir: str | Path, step: int) -> tuple[Path, Path, Path]:
    """``(root, final path, .partial path)`` of the checkpoint after ``step``, a stale
    ``.partial`` removed; every rank returns once it is gone."""
    root = Path(checkpoint_dir)
    path = root / f"step_{step:06d}"
    partial = root / f"{path.name}.partial"
    if rank() == 0 and partial.exists():
        shutil.rmtree(partial)  # left by a crash mid-save
    if dist.is_initialized():
        dist.barrier()
    return root, path, partial


def _finish(
    root: Path,
    path: Path,
    partial: Path,
    keep: int,
    files: dict[str, str] | None,
    writer: ChecksummingWriter,
) -> None:
    """After this rank wrote its files (``writer.records``) into ``partial``: rank 0 gathers every
    rank's records (so every rank has finished), adds ``files``, writes the manifest, renames
    ``partial`` to ``path`` and prunes to the newest ``keep``; every rank returns once that is
    done."""
    gathered = all_ranks(writer.records)  # also: every rank has finished writing
    if rank() == 0:
        manifest = {name: r for ranks in gathered for name, r in ranks.items()}
        for name, text in (files or {}).items():
            manifest[name] = write_file(partial / name, text.encode())
        write_manifest(partial, manifest)
        if path.exists():
            shutil.rmtree(path)
        partial.rename(path)
        if keep > 0:
            for _, old in checkpoints_in(root)[keep:]:
                shutil.rmtree(old)
    if dist.is_initialized():
        dist.barrier()  # every rank sees the checkpoint before it goes on


def _state(step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_state, optim_state = sharded_state(model, optimizer)
    return {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}


def save_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    keep: int = 0,
    files: dict[str, str] | None = None,
    background: AsyncCheckpointer | None = None,
) -> Path:
    """Write the state after ``step`` finished steps (every rank calls this); atomic, see the
    module docstring. ``keep`` > 0: keep only the newest ``keep`` checkpoints. ``files``: text
    files rank 0 adds to the checkpoint (e.g. the resolved recipe), name -> content.
    ``background``: write the shards in its thread and return; the checkpoint is completed
    (the same manifest and rename) by its next save or its :meth:`~AsyncCheckpointer.wait`."""
    if background is not None:
        background.wait()
    root, path, partial = _begin(checkpoint_dir, step)
    writer = ChecksummingWriter(partial)
    state = _state(step, model, optimizer)
    no_dist = not dist.is_initialized()
    with one_process_is_intended():
        if background is None:
            dcp.save(state, storage_writer=writer, no_dist=no_dist)
        else:
            group = background.group
            future = dcp.async_save(
                state, storage_writer=writer, process_group=group, no_dist=no_dist
            )
    finish = functools.partial(_finish, root, path, partial, keep, files, writer)
    if background is None:
        finish()
    else:
        background.pending = (future, finish)
    return path


class AsyncCheckpointer:
    """Where :func:`save_checkpoint` (``background=``) writes in the background: the state is
    copied to host memory (DCP's stager) and training goes on while the shards are written (and
    checksummed); the checkpoint is completed (the same manifest and rename as the synchronous
    save, so it is just as atomic) by the next save or by :meth:`wait`, which every rank must
    call before the run ends. DCP's collectives run on a gloo group of its own, never
    concurrently with the training's on the default group."""

    def __init__(self) -> None:
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.pending = None  # (the write's future, what completes the checkpoint)
        if not dist.is_initialized():  # the writer thread repeats DCP's one-process notice
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

    def wait(self) -> None:
        """Complete the checkpoint being written, if any (every rank)."""
        if self.pending is None:
            return
        future, finish = self.pending
        self.pending = None
        future.result()
        finish()
