"""Sequence packing: documents into fixed-capacity sequences, and the metadata that keeps them apart.

A packed sequence is described three equivalent ways, with converters between them:

- ``doc_ids`` [S] int64: 0 for padding, 1, 2, … for the documents in order (each id a contiguous run);
- an "indexed" attention mask [S]: the same thing as transformers' packed-FA2 convention
  (1, 2, 3, … per document, 0 for padding); here it IS ``doc_ids`` with ids renumbered 1..n in order;
- ``cu_seqlens`` [n_segments + 1] int32: boundaries of every run, padding runs included, so
  ``cu_seqlens[-1] == S`` and varlen kernels see every token.

Labels follow transformers' convention (the model shifts them by one): ``labels[i] = token[i]``,
except ``ignore_index`` at every document's first token — the only position whose prediction
would come from the previous document — and at padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

__all__ = [
    "PackedBatch",
    "cu_seqlens_from_doc_ids",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_indexed_mask",
    "indexed_mask_from_doc_ids",
    "pack_documents",
]


def pack_documents(
    lengths: Sequence[int], capacity: int, *, split_long: bool = False
) -> list[list[tuple[int, int, int]]]:
    """Assign documents to sequences of ``capacity`` tokens by first-fit decreasing.

    Returns one list per sequence of ``(doc_index, start, end)`` token ranges of the documents.
    Deterministic: documents are taken longest first (ties by index) and each goes into the
    first sequence with room. A document longer than ``capacity`` raises ``ValueError`` unless
    ``split_long=True``, in which case it is cut into ``capacity``-sized parts (each its own
    document for attention — the cut loses cross-part context, which is why it is opt-in).
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    items: list[tuple[int, int, int]] = []
    for i, n in enumerate(lengths):
        n = int(n)
        if n <= 0:
            raise ValueError(f"document {i} has length {n}; lengths must be positive")
        if n > capacity and not split_long:
            raise ValueError(
                f"document {i} has {n} tokens, more than the capacity {capacity}; "
                "pass split_long=True to cut it into capacity-sized parts"
            )
        items.extend((i, s, min(s + capacity, n)) for s in range(0, n, capacity))
    items.sort(key=lambda it: (-(it[2] - it[1]), it[0], it[1]))
    bins: list[list[tuple[int, int, int]]] = []
    free: list[int] = []
    for item in items:
        size = item[2] - item[1]
        for b, room in enumerate(free):
            if size <= room:
                bins[b].append(item)
                free[b] -= size
                break
        else:
            bins.append([item])
            free.append(capacity - size)
    return bins


def cu_seqlens_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """[S] ids → int32 boundaries of every run of equal ids (padding runs included)."""
    _check_1d(doc_ids, "doc_ids")
    s = doc_ids.numel()
    if s == 0:
        return torch.zeros(1, dtype=torch.int32, device=doc_ids.device)
    change = torch.nonzero(doc_ids[1:] != doc_ids[:-1]).flatten() + 1
    edges = [torch.zeros(1, dtype=change.dtype, device=doc_ids.device), change]
    edges.append(torch.full((1,), s, dtype=change.dtype, device=doc_ids.device))
    return torch.cat(edges).to(torch.int32)


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int32 boundaries → [S] ids 1, 2, … one per segment (no segment is treated as padding)."""
    _check_cu_seqlens(cu_seqlens)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(1, lengths.numel() + 1, device=cu_seqlens.device)
    return torch.repeat_interleave(ids, lengths)


def indexed_mask_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """[S] (or [B, S]) ids with 0 = padding → indexed mask numbering documents 1..n in order."""
    if doc_ids.dim() == 2:
        return torch.stack([indexed_mask_from_doc_ids(row) for row in doc_ids])
    _check_1d(doc_ids, "doc_ids")
    if doc_ids.numel() == 0:
        return doc_ids.clone()
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[1:] = doc_ids[1:] != doc_ids[:-1]
    start &= doc_ids != 0
    mask = torch.cumsum(start.long(), 0)
    return torch.where(doc_ids != 0, mask, torch.zeros_like(mask))


def doc_ids_from_indexed_mask(mask: torch.Tensor) -> torch.Tensor:
    """Indexed mask → doc ids. Rejects masks whose non-zero ids are not 1, 2, … in order."""
    _check_1d(mask, "indexed mask")
    nz = mask[mask != 0]
    if nz.numel():
        runs = torch.unique_consecutive(nz)
        expected = torch.arange(1, runs.numel() + 1, device=mask.device, dtype=runs.dtype)
        if not torch.equal(runs, expected):
            raise ValueError(
                f"an indexed mask numbers documents 1, 2, … in order; got runs {runs.tolist()[:16]}"
            )
    return mask.long()


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One packed sequence of ``S = capacity`` tokens (all tensors [S] unless stated).

    ``input_ids``; ``labels`` (see module docstring); ``doc_ids`` (0 = padding);
    ``position_ids`` restarting at 0 in every document (and in padding runs); ``cu_seqlens``
    int32 [n_segments + 1] over all runs incl. padding; ``max_seqlen`` the longest run.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @classmethod
    def from_documents(
        cls,
        documents: Sequence[torch.Tensor],
        capacity: int | None = None,
        *,
        pad_token_id: int = 0,
        ignore_index: int = -100,
    ) -> PackedBatch:
        """Concatenate 1-D token tensors in the given order, then pad to ``capacity`` at the end."""
        if not documents:
            raise ValueError("from_documents needs at least one document")
        for i, d in enumerate(documents):
            if d.dim() != 1 or d.numel() == 0:
                raise ValueError(
                    f"document {i}: expected a non-empty 1-D token tensor, got shape {tuple(d.shape)}"
                )
        total = sum(d.numel() for d in documents)
        capacity = total if capacity is None else capacity
        if total > capacity:
            raise ValueError(f"documents hold {total} tokens, more than the capacity {capacity}")
        device = documents[0].device
        pad = capacity - total
        input_ids = torch.cat(
            [*documents, torch.full((pad,), pad_token_id, dtype=documents[0].dtype, device=device)]
        )
        doc_ids = torch.cat(
            [
                torch.full((d.numel(),), i + 1, dtype=torch.long, device=device)
                for i, d in enumerate(documents)
            ]
            + [torch.zeros(pad, dtype=torch.long, device=device)]
        )
        return cls.from_doc_ids(input_ids, doc_ids, ignore_index=ignore_index)

    @classmethod
    def from_doc_ids(
        cls, input_ids: torch.Tensor, doc_ids: torch.Tensor, *, ignore_index: int = -100
    ) -> PackedBatch:
        """Build the metadata of an already packed sequence (padding may sit anywhere)."""
        _check_1d(input_ids, "input_ids")
        _check_1d(doc_ids, "doc_ids")
        if input_ids.shape != doc_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and doc_ids {tuple(doc_ids.shape)} differ in shape"
            )
        cu = cu_seqlens_from_doc_ids(doc_ids)
        lengths = (cu[1:] - cu[:-1]).long()
        starts = torch.repeat_interleave(cu[:-1].long(), lengths)
        position_ids = torch.arange(doc_ids.numel(), device=doc_ids.device) - starts
        labels = input_ids.clone().long()
        labels[(position_ids == 0) | (doc_ids == 0)] = ignore_index
        max_seqlen = int(lengths.max()) if lengths.numel() else 0
        return cls(input_ids, labels, doc_ids, position_ids, cu, max_seqlen)


def _check_1d(t: torch.Tensor, name: str) -> None:
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor [S], got shape {tuple(t.shape)}")


def _check_cu_seqlens(cu: torch.Tensor) -> None:
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(
            f"cu_seqlens: expected a 1-D tensor of at least one boundary, got shape {tuple(cu.shape)}"
        )
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    if cu.numel() > 1 and bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be strictly increasing, got {cu.tolist()[:16]}")
