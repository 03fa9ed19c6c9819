"""``train.deterministic``: the same recipe, launch and machine give the same run, bit for bit.

What made runs drift, and what makes them repeat:

- The kernels: every gather whose backward adds several gradient rows into one (the Gated
  DeltaNet conv windows, the chunked rule's chunks, the MoE's token → expert copies) uses
  ``index_select``, whose backward adds in a fixed order. Advanced indexing's backward
  (``index_put_`` with accumulation) runs with atomic adds on a multi-threaded CPU, in
  thread-timing order: that was the drift (cp-varlen-attn and moe-parallel, found by tracing
  every op of two runs). This holds whatever the flag says.
- The rest of a step is repeatable by construction: the data is a pure function of the
  recipe, the step and the loader's cursors (``data.workers`` only changes who reads it); gloo
  and FSDP2 reduce in a fixed order; the loss and the router are deterministic.
- ``deterministic: true`` (default) also turns on PyTorch's deterministic algorithms
  (``torch.use_deterministic_algorithms``, ``warn_only``: an op with no deterministic
  implementation runs anyway and is NAMED in a warning, once), cuDNN's deterministic mode, and
  on CUDA a fixed cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, set before cuBLAS
  starts unless already set). On GPUs the atomics paths of scatter / index-add kernels are then
  replaced by slower ordered ones; kernels outside PyTorch (fla's Triton kernels,
  TransformerEngine, flash-attn's backward) keep their own modes. ``deterministic: false``
  leaves PyTorch's defaults (faster on GPU, not repeatable there) and says so.

The same machine matters: another thread count or CPU changes how sums are split, repeatably.
The modes are set for the run only and restored afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

import torch

__all__ = ["NONDETERMINISTIC", "deterministic_mode", "prepare_cuda"]

logger = logging.getLogger("qwen35_trainer")

# the text of PyTorch's warning for an op without a deterministic implementation
NONDETERMINISTIC = "does not have a deterministic implementation"
CUBLAS_WORKSPACE = ":4096:8"


def prepare_cuda(deterministic: bool) -> None:
    """Before cuBLAS starts: the fixed workspace a deterministic cuBLAS needs (unless set)."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


@contextlib.contextmanager
def deterministic_mode(on: bool) -> Iterator[set[str]]:
    """PyTorch's deterministic modes on (``on``) for the block; yields the set of ops named as
    having no deterministic implementation (each logged once at WARNING)."""
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    named: set[str] = set()
    show = warnings.showwarning

    def name_it(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if NONDETERMINISTIC not in text:
            return show(message, category, filename, lineno, file, line)
        op = text.split(NONDETERMINISTIC)[0].strip()
        if op not in named:
            named.add(op)
            logger.warning(
                "train.deterministic: %s has no deterministic implementation on "
                "this device; runs may differ where it is used",
                op,
            )
        return None

    if on:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        warnings.showwarning = name_it
        logger.info(
            "train.deterministic: on (PyTorch's deterministic algorithms; an op without "
            "one is named when it first runs)"
        )
    else:
        logger.info(
            "train.deterministic: false: PyTorch's default kernels (on GPUs the atomics "
            "paths of scatter / index-add and cuDNN's fastest algorithms; runs are not "
            "repeatable bit for bit there)"
        )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=f".*{NONDETERMINISTIC}.*")
            yield named
    finally:
        warnings.showwarning = show
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[2:]
