"""The routed experts on CPU in pieces: runs of consecutive experts, each run's SwiGLU whole.

A step's expert computation over all rows at once makes temporaries of ``M`` rows — the sorted
rows, the projections' outputs, the adapters' terms, the activation, their gradients — tens of
MiB each at a training batch's ``M``. On CPU such an allocation is fresh pages from the kernel
every time (glibc maps anything over 32 MiB anew, and each page is faulted in and zeroed on
first touch: several times the cost of the pass that fills it), written out of cache and read
back. A per-expert loop has neither problem, which made a naive loop over merged weights as
fast as the grouped path despite its extra weight-gradient GEMMs.

So on CPU, for more rows than a piece holds and with the expert weights frozen (LoRA, an FP8
base; a trained weight's gradient would be assembled from the pieces' again, a full-size
copy), the experts run in pieces:
consecutive experts of about ``PIECE_ROWS`` rows and at
most ``PIECE_WEIGHTS`` elements of one projection's weights, each piece's SwiGLU (projections,
adapters, FP8 dequantization) whole before the next, so its temporaries are a few MiB the
allocator reuses. :func:`in_pieces` (inside :func:`moe_parallel.expert_swiglu`) splits sorted
rows; :func:`assignments_in_pieces` (``Experts`` without expert parallelism) goes from the
tokens to the [N, K, H] outputs piece by piece, so neither all sorted rows nor all their
outputs are ever whole. The weights and adapters are split with ``torch.split`` (one backward
assembling the whole gradient; an expert in no piece gets zeros). Each row meets exactly the
products it met over all rows (the grouped GEMM is one GEMM per expert either way), and the
gathers' gradients are added in the same order as one ``index_add_`` over all rows, so the
results are the same bit for bit (tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from moe_parallel.fp8 import FP8Weight

__all__ = [
    "PIECE_ROWS",
    "PIECE_WEIGHTS",
    "assignments_in_pieces",
    "expert_pieces",
    "in_pieces",
    "takes_pieces",
]

# a piece's rows: its temporaries, [rows, 2I] and [rows, H] a few, stay a few MiB
PIECE_ROWS = 2048
# a piece's weight elements of one projection: bounds an FP8 piece's dequantized weights
PIECE_WEIGHTS = 1 << 24


def takes_pieces(rows: int, device: torch.device, *weights) -> bool:
    """Whether the experts run in pieces (module docstring): more than ``PIECE_ROWS`` rows
    (token, expert assignments) on CPU and the expert weights frozen (a trained weight's
    gradient would be assembled from the pieces' again)."""
    frozen = all(isinstance(w, FP8Weight) or not w.requires_grad for w in weights)
    return device.type == "cpu" and rows > PIECE_ROWS and frozen


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


def _plan(counts_E: torch.Tensor, weights: list):
    """``(row sizes, counts per piece, weights per piece)`` of the pieces (module docstring)."""
    counts = counts_E.tolist()
    per_expert = max(math.prod(w.shape[1:]) for w in weights if w is not None)
    bounds = expert_pieces(counts, per_expert)
    expert_sizes = [b - a for a, b in bounds]
    split = [_split(w, expert_sizes) if w is not None else [None] * len(bounds) for w in weights]
    pieces = [[s[p] for s in split] for p in range(len(bounds))]
    return [sum(counts[a:b]) for a, b in bounds], torch.split(counts_E, expert_sizes), pieces


def in_pieces(
    x_MH: torch.Tensor,
    counts_E: torch.Tensor,
    weights: list,
    run: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """``run(x_piece, counts_piece, *weights_piece)`` over the pieces of the experts (module
    docstring), the rows concatenated; ``weights`` are stacked by expert (tensors, FP8, or
    ``None``)."""
    rows, counts, pieces = _plan(counts_E, weights)
    xs = torch.split(x_MH, rows)
    ys = [run(xs[p], counts[p], *pieces[p]) for p in range(len(rows)) if rows[p] > 0]
    return ys[0] if len(ys) == 1 else torch.cat(ys)


class _GatherRows(torch.autograd.Function):
    """Each piece's rows ``x_NH[token]``; the backward adds them back with one ``index_add_``
    a piece, pieces in order: the additions of one ``index_add_`` over all rows, in order."""

    @staticmethod
    def forward(ctx, x_NH, *tokens):
        ctx.save_for_backward(*tokens)
        ctx.rows = x_NH.shape[0]
        return tuple(x_NH.index_select(0, token) for token in tokens)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        grad_NH = None
        for token, grad in zip(ctx.saved_tensors, grads, strict=True):
            if grad is not None:
                if grad_NH is None:
                    grad_NH = grad.new_zeros(ctx.rows, grad.shape[1])
                grad_NH.index_add_(0, token, grad)
        return (grad_NH, *(None for _ in grads))


class _ScatterRows(torch.autograd.Function):
    """The pieces' rows written to their places in a fresh [N, K, H] tensor (not a view); the
    backward reads each piece's rows of the gradient back (``index_select``)."""

    @staticmethod
    def forward(ctx, shape, places, *ys):
        ctx.save_for_backward(*places)
        out_NKH = ys[0].new_empty(shape)
        for place, y in zip(places, ys, strict=True):
            out_NKH.view(-1, shape[-1]).index_copy_(0, place, y)
        return out_NKH

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_NKH):
        grad = grad_NKH.reshape(-1, grad_NKH.shape[-1])
        return (None, None, *(grad.index_select(0, place) for place in ctx.saved_tensors))


def assignments_in_pieces(
    x_NH: torch.Tensor,
    top_k: int,
    order_M: torch.Tensor,
    counts_E: torch.Tensor,
    weights: list,
    run: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """[N, K, H]: :func:`in_pieces` over the assignments ``order_M`` (the flat (token, slot)
    indices sorted by expert), each piece gathering its tokens' rows of ``x_NH`` and writing its
    rows back in assignment order; neither all rows sorted nor their outputs are made whole."""
    rows, counts, pieces = _plan(counts_E, weights)
    kept = [p for p in range(len(rows)) if rows[p] > 0]
    every = torch.split(order_M, rows)
    places = [every[p] for p in kept]
    xs = _GatherRows.apply(x_NH, *(place // top_k for place in places))
    ys = [run(x, counts[p], *pieces[p]) for x, p in zip(xs, kept, strict=True)]
    shape = (x_NH.shape[0], top_k, ys[0].shape[-1])
    return _ScatterRows.apply(shape, tuple(places), *ys)
