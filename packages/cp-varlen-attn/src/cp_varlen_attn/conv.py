"""``causal_conv1d``: the depthwise causal convolution of Gated DeltaNet, per document, under CP.

Layout: ``x`` is [1, T, C] (token-major, like every other per-token tensor here); transformers
applies ``nn.Conv1d(C, C, kernel, groups=C, padding=kernel - 1)`` to [B, C, T] and keeps the
first T outputs, i.e. ``y_t[c] = bias[c] + Σ_j weight[c, j] · x_{t-(kernel-1)+j}[c]`` with zeros
before the sequence start. Here the zeros are before each DOCUMENT start, so documents never
see each other's inputs.

Correctness: every output row is that sum over an explicit window of ``kernel`` input rows,
gathered by index from a buffer ``[local rows | halo rows | one zero row]``: rows before the
document start point at the zero row. Under CP a piece starting at offset ``s > 0`` needs its
document's rows ``[s - kernel + 1, s)``, which may live on any rank(s). Every rank exports the
rows that other ranks need (known from the layout alone) into a fixed number of slots of one
autograd all-gather (at most ``kernel - 1`` rows per piece); its backward is a
reduce-scatter, so each halo row's gradient is summed back onto its owner.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_varlen_attn.exchange import all_gather_autograd
from cp_varlen_attn.layout import CPLayout
from cp_varlen_attn.validation import check_call

__all__ = ["causal_conv1d"]

ACTIVATIONS = ("silu", None)


@torch.compiler.disable  # layout-driven Python: compiled callers run it eagerly
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    layout: CPLayout | None = None,
    group: dist.ProcessGroup | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv1d that restarts at every document.

    Args:
        x: [1, T, C] inputs (this rank's tokens in layout order under CP).
        weight: [C, kernel] (or ``nn.Conv1d``'s [C, 1, kernel]).
        bias: [C] or ``None``.
        cu_seqlens: int [N + 1] document boundaries without a layout (``None``: one document).
        layout, group: CP layout and its process group; halo rows come from their owners.
        activation: ``"silu"`` or ``None``.
    Returns:
        [1, T, C] in x's dtype.
    """
    rank = dist.get_rank(group) if group is not None else 0
    if isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    error = _local_error(x, weight, bias, cu_seqlens, layout, group, rank, activation)
    if isinstance(layout, CPLayout):
        check_call(layout, group, error)
    elif error is not None:
        raise ValueError(error)
    kernel = weight.shape[1]
    x_TC = x[0].to(weight.dtype)
    if layout is None:
        cu = (0, x.shape[1]) if cu_seqlens is None else tuple(int(c) for c in cu_seqlens)
        index, exports, width = _single_rank_index(cu, kernel), None, 0
    else:
        index, exports, width = _cp_index(layout, rank, kernel)
    parts = [x_TC]
    if width > 0:
        send = x_TC.index_select(0, exports.to(x.device))
        send = torch.cat([send, send.new_zeros(width - send.shape[0], send.shape[1])])
        parts.append(all_gather_autograd(send.contiguous(), gather_dim=0, group=group))
    parts.append(x_TC.new_zeros(1, x_TC.shape[1]))
    buffer_RC = torch.cat(parts)
    # index_select, not buffer_RC[index]: advanced indexing's backward is index_put_ with
    # accumulate=True, which on a multi-threaded CPU adds the (up to ``kernel``) gradients of
    # a row with atomics in thread-timing order (run-to-run different sums); index_select's
    # backward is index_add_, which adds them in a fixed order.
    windows_TKC = buffer_RC.index_select(0, index.to(x.device).reshape(-1))
    windows_TKC = windows_TKC.view(*index.shape, buffer_RC.shape[1])
    out_TC = (windows_TKC * weight.T).sum(1)
    if bias is not None:
        out_TC = out_TC + bias
    if activation == "silu":
        out_TC = F.silu(out_TC)
    return out_TC.to(x.dtype).unsqueeze(0)


@functools.lru_cache(maxsize=32)
def _single_rank_index(cu: tuple[int, ...], kernel: int) -> torch.Tensor:
    seq = cu[-1]
    pos = torch.arange(seq)
    doc_start = torch.repeat_interleave(
        torch.tensor(cu[:-1]), torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    )
    src = pos[:, None] - (kernel - 1) + torch.arange(kernel)[None, :]
    return torch.where(src >= doc_start[:, None], src, seq)


@functools.lru_cache(maxsize=32)
def _cp_index(layout: CPLayout, rank: int, kernel: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(window index [T_local, kernel] into the buffer, local rows this rank exports, slots per rank)."""
    cp, seq = layout.cp_size, layout.seq_len
    owner = torch.empty(seq, dtype=torch.long)
    local_row = torch.empty(seq, dtype=torch.long)
    for r in range(cp):
        pos = layout.positions(r)
        owner[pos] = r
        local_row[pos] = torch.arange(pos.numel())
    doc_start = torch.empty(seq, dtype=torch.long)
    for d in range(layout.num_docs):
        doc_start[layout.cu_seqlens[d] : layout.cu_seqlens[d + 1]] = layout.cu_seqlens[d]
    # Global positions each rank needs from other ranks: the halo before each of its pieces.
    exported: list[set[int]] = [set() for _ in range(cp)]
    for r, pcs in enumerate(layout.pieces):
        for p in pcs:
            g0 = layout.cu_seqlens[p.doc] + p.start
            for gp in range(max(layout.cu_seqlens[p.doc], g0 - kernel + 1), g0):
                if int(owner[gp]) != r:
                    exported[int(owner[gp])].add(gp)
    export_pos = [sorted(e) for e in exported]
    width = max((len(e) for e in export_pos), default=0)
    slot_of = torch.full((seq,), -1, dtype=torch.long)
    for r, ex in enumerate(export_pos):
        slot_of[torch.tensor(ex, dtype=torch.long)] = r * width + torch.arange(len(ex))
    n_local = layout.local_len(rank)
    pos = layout.positions(rank)
    src = pos[:, None] - (kernel - 1) + torch.arange(kernel)[None, :]
    valid = src >= doc_start[pos][:, None]
    src_c = src.clamp(min=0)
    rows = torch.where(owner[src_c] == rank, local_row[src_c], n_local + slot_of[src_c])
    zero_row = n_local + cp * width
    index = torch.where(valid, rows, zero_row)
    return index, local_row[torch.tensor(export_pos[rank], dtype=torch.long)], width


def _local_error(x, weight, bias, cu_seqlens, layout, group, rank, activation) -> str | None:
    if activation not in ACTIVATIONS:
        return f"activation must be one of {ACTIVATIONS}, got {activation!r}"
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != 1:
        return f"x must be [1, T, C], got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        return f"weight must be [C, kernel] (or [C, 1, kernel]) with C={x.shape[2]}, got {tuple(getattr(weight, 'shape', ()))}"
    if bias is not None and tuple(bias.shape) != (x.shape[2],):
        return f"bias must be [C] = [{x.shape[2]}], got {tuple(bias.shape)}"
    if layout is None:
        if cu_seqlens is not None:
            cu = [int(c) for c in cu_seqlens]
            if (
                len(cu) < 2
                or cu[0] != 0
                or cu[-1] != x.shape[1]
                or any(b <= a for a, b in itertools.pairwise(cu))
            ):
                return f"cu_seqlens must start at 0, increase strictly and end at T={x.shape[1]}; got {cu[:16]}"
        return None
    if cu_seqlens is not None and tuple(int(c) for c in cu_seqlens) != layout.cu_seqlens:
        return "cu_seqlens differ from layout.cu_seqlens (under CP the layout's are used; pass None or the same)"
    world = dist.get_world_size(group) if group is not None else 1
    if world != layout.cp_size:
        return f"the layout is for {layout.cp_size} CP ranks but the group has {world}"
    if x.shape[1] != layout.local_len(rank):
        return (
            f"rank {rank} holds {layout.local_len(rank)} tokens in the layout but got {x.shape[1]}"
        )
    return None
