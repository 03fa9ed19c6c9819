"""Plain single-process references: full logits, ``F.cross_entropy``, float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_inputs(n, h, v, *, seed=0, ignore_frac=0.3, ignore_index=-100, bias=True, shape=None):
    """Random fp32 hidden [N, H], weight [V, H], bias [V] and labels [N] with some ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5
    b = torch.randn(v, generator=g) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = ignore_index
    if shape is not None:
        hidden, labels = hidden.reshape(*shape, h), labels.reshape(shape)
    return hidden, weight, b, labels


def reference(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    reduction="mean",
    label_smoothing=0.0,
    ignore_index=-100,
    grad_out=None,
):
    """Loss and gradients (hidden, weight, bias) of F.cross_entropy on full float64 logits.

    "mean" with every label ignored is defined as 0 (F.cross_entropy gives NaN)."""
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    b = bias.detach().double().requires_grad_() if bias is not None else None
    logits = leaves[0] @ leaves[1].T
    if b is not None:
        logits = logits + b
    loss = F.cross_entropy(
        logits.reshape(-1, weight.shape[0]),
        labels.reshape(-1),
        reduction="sum" if reduction == "mean" else reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )
    if reduction == "mean":
        loss = loss / max(int((labels != ignore_index).sum()), 1)
    if reduction == "none":
        loss = loss.reshape(labels.shape)
    grad_out = torch.ones_like(loss) if grad_out is None else grad_out.double()
    wrt = leaves + ([b] if b is not None else [])
    grads = torch.autograd.grad(loss, wrt, grad_out)
    return loss.detach(), list(grads) + ([None] if b is None else [])
