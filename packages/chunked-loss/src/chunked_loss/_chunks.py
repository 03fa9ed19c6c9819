"""What both loss paths share: options, the rows that are computed, the block, the buffers.

Only non-ignored tokens are computed: an ignored token's loss is 0 and all its gradients are 0 by
definition, so its row of ``hidden`` never enters a matmul (``Rows``: the indices of the valid
tokens, found with one host sync). The chunks are ``chunk_size`` consecutive VALID rows, gathered
from ``hidden`` ([C, H] copies) and scattered back into ``∂hidden``.

Per chunk, ``_matmul.chunk_logits`` writes ``z = h W^T + b`` into one fp32 [C, V] block
allocated once per call (``Blocks``; a fresh multi-hundred-MiB block per chunk would be
page-faulted in every time) plus once for a shorter tail, the kernels of ``_kernels`` turn it
into ``∂loss/∂z`` in place, and ``_matmul.accumulate`` contracts it into the gradient buffers of
``grad_buffers``: ``∂h[rows] = dz W`` (in hidden's dtype), ``∂W += dzᵀ h`` and
``∂b += Σ_rows dz`` (fp32).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

__all__ = ["Blocks", "Rows", "Spec", "grad_buffers"]


@dataclasses.dataclass(frozen=True)
class Spec:
    """Non-tensor options. ``vocab_start``/``vocab_total`` locate this rank's weight rows in the
    full vocabulary; ``group`` is the TP group the vocabulary is split over (None: not split);
    ``compiled`` is the caller's choice of per-chunk kernels (see ``_kernels``)."""

    ignore_index: int
    label_smoothing: float
    chunk_size: int
    vocab_start: int
    vocab_total: int
    group: dist.ProcessGroup | None = None
    compiled: bool | None = None

    @property
    def smooth(self) -> float:
        """ε / V: the smoothing mass of every column."""
        return self.label_smoothing / self.vocab_total

    @property
    def keep(self) -> float:
        """1 − ε: the weight of the target column."""
        return 1.0 - self.label_smoothing


@dataclasses.dataclass(frozen=True)
class Rows:
    """The M valid tokens: ``index_M`` into [N]; ``here_M`` their target column lies in this
    vocabulary slice, ``col_M`` that column (0 where not here), ``tw_M`` = (1 − ε)·here."""

    index_M: torch.Tensor
    here_M: torch.Tensor
    col_M: torch.Tensor
    tw_M: torch.Tensor

    @staticmethod
    def of(labels_N: torch.Tensor, spec: Spec, local_vocab: int) -> Rows:
        index_M = (labels_N != spec.ignore_index).nonzero().squeeze(1)
        col_M = labels_N[index_M].long() - spec.vocab_start
        here_M = (col_M >= 0) & (col_M < local_vocab)
        tw_M = here_M.to(torch.float32) * spec.keep
        return Rows(index_M, here_M, torch.where(here_M, col_M, 0), tw_M)

    def __len__(self) -> int:
        return self.index_M.numel()

    def chunks(self, chunk_size: int):
        """``(start, end)`` of each chunk of valid rows."""
        m = len(self)
        return [(s, min(s + chunk_size, m)) for s in range(0, m, chunk_size)]


class Blocks:
    """The fp32 [C, V_r] block each chunk's logits are written into: one for all the full
    chunks and, after it is released, one for the shorter tail (the last chunk). Each is a
    tensor of its own, not a view, so the compiled kernels see the same kind of input for
    every chunk (Dynamo guards on a view's base)."""

    def __init__(self, local_vocab: int, device: torch.device) -> None:
        self._shape_V = (local_vocab,)
        self._device = device
        self._block: torch.Tensor | None = None

    def get(self, rows: int) -> torch.Tensor:
        if self._block is None or self._block.shape[0] != rows:
            self._block = None
            self._block = torch.empty(
                (rows, *self._shape_V), dtype=torch.float32, device=self._device
            )
        return self._block


def grad_buffers(hidden_NH, weight_VH, need_h: bool, need_w: bool, need_b: bool):
    """Zeroed gradient accumulators: hidden in its own dtype, weight and bias in fp32 (None where
    no gradient is needed)."""
    grad_h = torch.zeros_like(hidden_NH) if need_h else None
    f32 = {"dtype": torch.float32, "device": weight_VH.device}
    grad_w32 = torch.zeros(weight_VH.shape, **f32) if need_w else None
    grad_b32 = torch.zeros(weight_VH.shape[0], **f32) if need_b else None
    return grad_h, grad_w32, grad_b32
