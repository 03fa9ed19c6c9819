"""Next-token accuracy without [tokens, vocab] logits: the arg-max of the head's logits,
``chunk`` tokens at a time, compared with the valid labels (the held-out evaluation's
``eval_accuracy`` and the MTP head's ``eval_mtp_accuracy``)."""

from __future__ import annotations

import torch

from qwen35_trainer.data import IGNORE_INDEX

__all__ = ["ACCURACY_CHUNK", "count_correct"]

ACCURACY_CHUNK = 4096  # tokens per arg-max chunk: [4096, vocab] logits at a time


@torch.no_grad()
def count_correct(
    hidden_BSH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    labels_BS: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """How many valid labels equal the arg-max of ``hidden @ weight.T (+ bias)``, computed
    ``chunk`` tokens at a time (fp32 scalar)."""
    if hasattr(weight_VH, "full_tensor"):  # a DTensor (TP): the whole head
        weight_VH = weight_VH.full_tensor()
        bias_V = bias_V.full_tensor() if bias_V is not None else None
    hidden_NH = hidden_BSH.reshape(-1, hidden_BSH.shape[-1])
    labels_N = labels_BS.reshape(-1)
    keep = labels_N != IGNORE_INDEX
    hidden_NH, labels_N = hidden_NH[keep], labels_N[keep]
    correct = torch.zeros((), device=hidden_BSH.device)
    for first in range(0, labels_N.numel(), chunk):
        logits = hidden_NH[first : first + chunk] @ weight_VH.to(hidden_NH.dtype).T
        if bias_V is not None:
            logits = logits + bias_V
        correct += (logits.argmax(-1) == labels_N[first : first + chunk]).sum()
    return correct
