"""Hugging Face checkpoint interop: start from a transformers checkpoint, export one.

Our model IS transformers' ``Qwen3_5MoeForConditionalGeneration`` with its sparse blocks
replaced by :class:`moe_parallel.MoE` under the same parameter names and shapes, so both
directions go through transformers itself, including the conversions it applies between the
on-disk layout and the runtime one (e.g. per-expert tensors on the Hub vs the stacked 3-D
experts in memory):

- :func:`load_hf_weights`: ``from_pretrained`` builds transformers' model from the checkpoint,
  its state dict is loaded strictly into ours (same keys, same shapes: a checkpoint of another
  architecture fails here, naming the keys). This briefly holds two copies of the weights on
  the host; loading straight into sharded parameters is future work.
- :func:`export_hf`: the full (gathered) state dict is written by ``save_pretrained`` of our
  model on rank 0, with the config; transformers' own class loads the directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

__all__ = ["export_hf", "load_hf_weights"]


def load_hf_weights(model: nn.Module, path: str | Path) -> None:
    """Load the weights of the transformers checkpoint at ``path`` into ``model`` (unsharded)."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    source = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
    theirs = source.state_dict()
    ours = model.state_dict()
    shapes = [k for k in ours if k in theirs and ours[k].shape != theirs[k].shape]
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if shapes or missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not fit the recipe's model: shape mismatches {shapes[:5]}, "
            f"missing {missing[:5]}, unexpected {unexpected[:5]} (first 5 of each)"
        )
    model.load_state_dict(theirs, strict=True)


def export_hf(model: nn.Module, path: str | Path) -> None:
    """Write ``model`` (the transformers model, possibly FSDP/EP-sharded) as a transformers
    checkpoint directory. Every rank calls this; rank 0 writes."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))  # fmt: skip
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(str(path), state_dict=state)
    if dist.is_initialized():
        dist.barrier()
