"""Safetensors files written with the mode every other file of their folder gets.

safetensors' ``save_file`` creates its file owner-only (mode ``0600``), whereas ``open()`` —
``config.json``, the index, the tokenizer files copied beside them — creates ``0666`` less the
process's umask (``0644`` under the usual ``022``). An export is read by others: a server
running as another user could then read the folder's config but not its weights. So each
weight file is given, right after it is written, the mode ``open()`` would have given it
(:func:`creation_mode`), by the rank that wrote it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["creation_mode", "save_tensors"]


def creation_mode() -> int:
    """``0666`` less this process's umask: the mode ``open()`` gives a new file. The umask is
    read from ``/proc/self/status`` where Linux shows it (setting it to read it back, the only
    other way, would race with a thread creating a file meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """``safetensors.torch.save_file(tensors, path)`` (``{"format": "pt"}`` metadata, as
    transformers writes it), then the file's mode set to :func:`creation_mode`."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, creation_mode())
