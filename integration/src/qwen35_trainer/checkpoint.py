"""Save and resume training with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is the directory ``<checkpoint_dir>/step_<NNNNNN>`` holding the model and optimizer
state (``torch.distributed.checkpoint.state_dict``: FSDP2 / EP DTensor shards are written by
their owners and re-sharded on load, so a checkpoint can be resumed under another layout) and the
number of finished steps. DCP writes the ``.metadata`` file last, so only directories that have
it are complete; resuming takes the newest complete one.

Why a resumed run continues exactly: the model and optimizer tensors are restored bit for bit,
the data stream is a pure function of the step index (:mod:`qwen35_trainer.data`), and nothing
else in a step is random (the model has no dropout; the expert dispatch is deterministic).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]

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


def save_checkpoint(
    checkpoint_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
) -> Path:
    """Write the state after ``step`` finished steps (every rank calls this)."""
    path = Path(checkpoint_dir) / f"step_{step:06d}"
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}
    with _one_process_is_intended():
        dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    return path


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore ``model`` and ``optimizer`` in place from ``path``; returns the finished steps."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
    with _one_process_is_intended():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(state["step"])
