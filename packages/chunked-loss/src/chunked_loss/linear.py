"""``linear_cross_entropy``: cross-entropy of ``hidden @ weight.T + bias`` without [N, V] logits.

The math and the memory argument live in ``_fused`` (gradients formed during the forward, for a
scalar loss, also vocab-parallel) and ``_function`` (backward recomputes each chunk); the
per-chunk elementwise work in ``_kernels`` (compiled or eager) and what both paths share in
``_chunks``. This module checks the arguments, flattens [B, S, ...] to [N, ...], picks the
vocab-parallel path when ``weight`` is a DTensor, picks one of the two Functions
(``grad_in_forward``) and applies the reduction. Both give the same loss and gradients; "mean"
is the summed loss divided by a constant either way. On the vocab-parallel path the input checks
are agreed over the TP group before anyone raises, so no rank is left waiting in the loss's
collectives.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from chunked_loss._checks import (
    check_label_range,
    check_options,
    check_shapes,
    check_weight,
    linear_chunk_size,
)
from chunked_loss._chunks import Spec
from chunked_loss._function import LinearCrossEntropyFunction
from chunked_loss._fused import FusedLinearCrossEntropyFunction
from chunked_loss._matmul import env_error
from chunked_loss._reduce import reduce_loss
from chunked_loss._vocab_parallel import VocabShard, agree, vocab_shard

__all__ = ["linear_cross_entropy"]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    label_smoothing: float = 0.0,
    num_valid_tokens: int | torch.Tensor | None = None,
    grad_in_forward: bool | None = None,
    compiled: bool | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, labels)``, computed ``chunk_size`` tokens at a time.

    Args:
        hidden: [N, H] or [B, S, H] activations (any float dtype; weight must match).
        weight: [V, H] output projection. A DTensor sharded ``Shard(0)`` over one mesh dim (TP)
            makes each rank work on its vocabulary slice (any V, also not divisible by TP);
            ``hidden`` and ``labels`` must then be the same on every rank of that dim.
        labels: [N] or [B, S] integer targets in ``[0, V)`` or equal to ``ignore_index``.
        bias: optional [V] (a DTensor laid out like ``weight`` when ``weight`` is one).
        reduction: ``"mean"`` over valid tokens (or over ``num_valid_tokens``), ``"sum"``, or
            ``"none"`` (per-token losses shaped like ``labels``, 0 where ignored).
        chunk_size: valid tokens per chunk; ``None`` picks the largest chunk whose working set
            fits 256 MiB for this V (per process), H and dtype (see the README for the formula;
            269 rows for fp32 at V = 248,320, H = 1024).
        label_smoothing: ε in [0, 1], as in ``F.cross_entropy``.
        num_valid_tokens: the global number of non-ignored labels (all DP/CP ranks and
            micro-batches, see ``global_num_valid_tokens``); ``"mean"`` divides by it.
        grad_in_forward: ``None`` (auto) computes the gradients during the forward (3 matmuls
            per chunk, like the naive loss) whenever that is exact and useful — ``reduction`` is
            ``"mean"``/``"sum"``, grad mode is on and some input requires grad (vocab-parallel
            included) — and otherwise recomputes each chunk's logits in backward (4 matmuls,
            nothing but [M] floats saved beyond the inputs). ``True`` forces the former
            (``ValueError`` for ``reduction="none"``), ``False`` the latter, e.g. when many
            forwards run without a backward, or to free the [V, H] weight gradient between
            forward and backward.
        compiled: the per-chunk softmax/gradient kernels. ``None`` (auto) uses
            ``torch.compile``d kernels (one fused pass writing the gradient into the chunk's
            logits) where Inductor works on this device, and otherwise the exact eager kernels,
            logging why once per device type (logger ``"chunked_loss"``); ``True`` raises
            ``RuntimeError`` instead of falling back; ``False`` always runs eagerly.

    Returns:
        fp32 loss: a scalar, or [N] / [B, S] for ``reduction="none"``. With every label ignored
        the loss is 0 and all gradients are zero. Softmax statistics are fp32; for bf16 inputs the
        logits of each chunk come from a bf16 matmul (as with ``F.linear``) and are then upcast.
        Double backward is not supported and raises a ``RuntimeError``.
    """
    check_options(reduction, chunk_size, label_smoothing, num_valid_tokens)
    if compiled is not None and not isinstance(compiled, bool):
        raise TypeError(f"compiled must be a bool or None, got {type(compiled).__name__}")
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(hidden, DTensor) or isinstance(labels, DTensor):
        raise TypeError(
            "hidden and labels must be plain tensors (the same on every TP rank); only weight "
            "and bias may be DTensors"
        )
    if isinstance(weight, DTensor):
        shard = vocab_shard(weight, bias)
    else:
        if isinstance(bias, DTensor):
            raise TypeError("bias is a DTensor but weight is not; shard both or neither")
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        shard = VocabShard(weight, bias, 0, weight.shape[0], None)
    error = (
        check_shapes(hidden, labels)
        or check_weight(hidden, weight.shape, None if bias is None else bias.shape)
        or _check_dtypes(hidden, shard)
        or check_label_range(labels, shard.vocab, ignore_index)
        or env_error()
    )
    fused = _use_grad_in_forward(grad_in_forward, reduction, shard, hidden)
    agree(error, shard.group, fused)
    spec = Spec(
        ignore_index=ignore_index,
        label_smoothing=float(label_smoothing),
        chunk_size=chunk_size
        or linear_chunk_size(shard.weight.shape[0], hidden.shape[-1], hidden.dtype),
        vocab_start=shard.start,
        vocab_total=shard.vocab,
        group=shard.group,
        compiled=compiled,
    )
    args = (hidden.reshape(-1, hidden.shape[-1]), shard.weight, shard.bias, labels.reshape(-1))
    if fused:
        total = FusedLinearCrossEntropyFunction.apply(*args, spec)
        return reduce_loss(total, labels, reduction, ignore_index, num_valid_tokens)
    loss_N = LinearCrossEntropyFunction.apply(*args, spec)
    return reduce_loss(loss_N, labels, reduction, ignore_index, num_valid_tokens)


def _use_grad_in_forward(
    choice: bool | None, reduction: str, shard: VocabShard, hidden: torch.Tensor
) -> bool:
    """Resolve ``grad_in_forward``: the fused path needs a scalar loss (a per-token upstream
    gradient is unknown in the forward)."""
    if choice is None:
        tensors = (hidden, shard.weight, shard.bias)
        return (
            reduction != "none"
            and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in tensors)
        )
    if not isinstance(choice, bool):
        raise TypeError(f"grad_in_forward must be a bool or None, got {type(choice).__name__}")
    if choice and reduction == "none":
        raise ValueError(
            'grad_in_forward=True needs a scalar loss (reduction "mean" or "sum"), got '
            'reduction="none"'
        )
    return choice


def _check_dtypes(hidden: torch.Tensor, shard: VocabShard) -> str | None:
    if not hidden.is_floating_point():
        return f"hidden must be a floating-point tensor, got {hidden.dtype}"
    for name, t in (("weight", shard.weight), ("bias", shard.bias)):
        if t is not None and t.dtype != hidden.dtype:
            return f"{name} dtype {t.dtype} differs from hidden dtype {hidden.dtype}"
    return None
