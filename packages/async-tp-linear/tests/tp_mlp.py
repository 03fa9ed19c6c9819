"""The column → row parallel MLP with sequence parallel that the multi-rank tests compile."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """LayerNorm → up (column-parallel) → ReLU → down (row-parallel); hidden ``h``, width ``f``."""

    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, f)
        self.down = nn.Linear(f, h)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


def sequence_parallel_plan() -> dict:
    """The ``parallelize_module`` plan: norm sequence-parallel, up colwise, down rowwise."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
