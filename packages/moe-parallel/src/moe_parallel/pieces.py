"""The routed experts on CPU in pieces: runs of consecutive experts, each run's SwiGLU whole.

A step's expert computation over all rows at once makes temporaries of ``M`` rows — the
projections' outputs, the adapters' terms, the activation, their gradients — tens of MiB each
at a training batch's ``M``. On CPU such an allocation is fresh pages from the kernel every time
(glibc maps anything over 32 MiB anew, and each page is faulted in and zeroed on first touch:
several times the cost of the pass that fills it), and it is written out of cache and read back.
A per-expert loop has neither problem, which made a naive loop over merged weights as fast as
the grouped path here despite its extra weight-gradient GEMMs.

So on CPU :func:`moe_parallel.expert_swiglu` runs in pieces: consecutive experts of about
``PIECE_ROWS`` rows and at most ``PIECE_WEIGHTS`` elements of one projection's weights, each
piece's SwiGLU (its projections, adapters, FP8 dequantization) whole before the next, so its
temporaries are a few MiB the allocator reuses. The rows, the weights and the adapters are
split with ``torch.split`` (one backward each, assembling the whole gradient; an expert with no
rows, in no piece, gets zeros) and the pieces' outputs concatenated. Each row meets exactly the
products it met over all rows (the grouped GEMM is one GEMM per expert either way), so the
result is the same bit for bit (tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from moe_parallel.fp8 import FP8Weight

__all__ = ["PIECE_ROWS", "PIECE_WEIGHTS", "expert_pieces", "in_pieces"]

# a piece's rows: its temporaries, [rows, 2I] and [rows, H] a few, stay a few MiB
PIECE_ROWS = 2048
# a piece's weight elements of one projection: an FP8 piece's dequantized weights (2 bytes an
# element in bf16) stay in the few MiB the allocator reuses
PIECE_WEIGHTS = 1 << 24


def expert_pieces(counts: list[int], weights_per_expert: int) -> list[tuple[int, int]]:
    """``[(first expert, end expert), ...]``: consecutive runs covering every expert, each
    closed once it has ``PIECE_ROWS`` rows or ``PIECE_WEIGHTS`` weight elements (module
    docstring)."""
    most = max(1, PIECE_WEIGHTS // max(1, weights_per_expert))
    bounds, start, rows = [], 0, 0
    for e, n in enumerate(counts):
        rows += n
        if rows >= PIECE_ROWS or e + 1 - start == most:
            bounds.append((start, e + 1))
            start, rows = e + 1, 0
    if start < len(counts):
        bounds.append((start, len(counts)))
    return bounds


def _split(weight, sizes: list[int]) -> list:
    if isinstance(weight, FP8Weight):  # frozen bytes: plain slices
        datas, scales = torch.split(weight.data, sizes), torch.split(weight.scale, sizes)
        return [FP8Weight(d, s, weight.form) for d, s in zip(datas, scales, strict=True)]
    return list(torch.split(weight, sizes))


def in_pieces(
    x_MH: torch.Tensor,
    counts_E: torch.Tensor,
    weights: list,
    run: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """``run(x_piece, counts_piece, *weights_piece)`` over the pieces of the experts (module
    docstring), the rows concatenated; ``weights`` are stacked by expert (tensors, FP8, or
    ``None``)."""
    counts = counts_E.tolist()
    per_expert = max(math.prod(w.shape[1:]) for w in weights if w is not None)
    bounds = expert_pieces(counts, per_expert)
    expert_sizes = [b - a for a, b in bounds]
    row_sizes = [sum(counts[a:b]) for a, b in bounds]
    xs = torch.split(x_MH, row_sizes)
    cs = torch.split(counts_E, expert_sizes)
    split = [_split(w, expert_sizes) if w is not None else [None] * len(bounds) for w in weights]
    ys = [run(xs[p], cs[p], *(s[p] for s in split)) for p in range(len(bounds)) if row_sizes[p] > 0]
    return ys[0] if len(ys) == 1 else torch.cat(ys)
