"""A toy VLM with the container names of transformers' Qwen3.5 (``visual.blocks``,
``language_model.layers``): causal SDPA attention, dropout, and MoE MLPs in the language model."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from moe_parallel import MoE


class Block(nn.Module):
    def __init__(self, dim: int = 16, moe: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.drop = nn.Dropout(0.2)
        self.mlp = MoE(dim, 4, 2, 8, 8, init_std=0.2) if moe else nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        x = x + self.drop(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1))
        return x + self.mlp(x)


class Tower(nn.Module):
    def __init__(self, n: int, moe: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(moe=moe) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Language(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = Tower(2, moe=True).blocks

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


class VLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.visual = Tower(2)
        self.language_model = Language()

    def forward(self, x):
        return self.language_model(self.visual(x))
