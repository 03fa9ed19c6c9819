"""Layout agreement once per step, not once per layer.

Every rank of a CP group must pass the SAME layout to every CP call, with its own token count;
otherwise the exchanges pair up wrong rows or hang. Checking that needs a collective, and a
collective per layer (and again in each activation-checkpoint recompute) is a blocking round
trip on the hot path. So the agreement is made once per layout object:
:func:`validate_layout` does one all-reduce (layout digest, group size, every rank's local
token count and error flag) and records the group on that layout object. A CP call
(``varlen_attention``, ``causal_conv1d``, ``gated_delta_rule``) whose layout object is already
validated for its group checks its inputs locally only; one that is not runs the agreement
itself, once, so callers that never call :func:`validate_layout` stay safe.

The record is by object identity, not equality: a fresh layout (the next step's) is agreed
anew. What is not caught after validation: one rank later passing a different layout object
while the others pass the validated one — the per-step :func:`validate_layout` call is what
catches a stale or diverging layout.
"""

from __future__ import annotations

import torch.distributed as dist

from cp_varlen_attn._agree import agreed_errors, raise_if_bad
from cp_varlen_attn.layout import CPLayout

__all__ = ["check_call", "is_validated", "validate_layout"]

_RECORD = "_validated_groups"


def layout_digest(layout: CPLayout) -> int:
    """A 62-bit digest of the layout, equal in every process for equal layouts (tuples of ints
    hash the same everywhere; only str/bytes hashing is salted)."""
    return hash((layout.cu_seqlens, layout.pieces)) & ((1 << 62) - 1)


def is_validated(layout: CPLayout, group: dist.ProcessGroup | None) -> bool:
    """True when the ranks of ``group`` agreed on this layout object (or there is nobody to
    agree with)."""
    if group is None or dist.get_world_size(group) == 1:
        return True
    return id(group) in getattr(layout, _RECORD, ())


def validate_layout(
    layout: CPLayout,
    group: dist.ProcessGroup | None,
    *,
    local_tokens: int | None = None,
    error: str | None = None,
) -> None:
    """Agree, in one all-reduce over ``group``, that every rank holds this same layout, that the
    group has ``layout.cp_size`` ranks and (if given) that this rank holds
    ``layout.local_len(rank)`` tokens; raise the same ``ValueError`` on every rank otherwise.

    Call it once per step with the step's layout (e.g. where the packed batch is sharded); the
    CP calls of that step then do no validation collective. ``error``: a local problem found by
    the caller, agreed along (every rank raises).
    """
    if not isinstance(layout, CPLayout):
        raise TypeError(f"layout must be a CPLayout, got {type(layout).__name__}")
    if group is None or dist.get_world_size(group) == 1:
        if error is None and layout.cp_size != 1:
            error = (
                f"the layout is for {layout.cp_size} CP ranks but there is no group of that size"
            )
        if error is not None:
            raise ValueError(error)
        return
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if error is None and world != layout.cp_size:
        error = f"the layout is for {layout.cp_size} CP ranks but the group has {world}"
    if error is None and local_tokens is not None and local_tokens != layout.local_len(rank):
        error = f"rank {rank} holds {layout.local_len(rank)} tokens in the layout but got {local_tokens}"
    digest = layout_digest(layout)
    bad, (high, neg_low) = agreed_errors(error, group, [digest, -digest])
    if error is None and not bad and high != -neg_low:
        error = "ranks passed different layouts: every rank must plan the same CPLayout"
        bad = [rank]
    raise_if_bad(error, bad)
    object.__setattr__(layout, _RECORD, (*getattr(layout, _RECORD, ()), id(group)))


def check_call(layout: CPLayout, group: dist.ProcessGroup | None, error: str | None) -> None:
    """A CP call's check: local only when the layout is validated for ``group``, else the
    agreement of :func:`validate_layout` (which then records it)."""
    if is_validated(layout, group):
        if error is not None:
            raise ValueError(error)
        return
    validate_layout(layout, group, error=error)
