"""A tiny real transformers Qwen3.5 vision tower and random batches for it (test helper)."""

from __future__ import annotations

import torch
from transformers.models.qwen3_5_moe import Qwen3_5MoeVisionConfig, Qwen3_5MoeVisionModel

MERGE = 2
PIXEL_WIDTH = 3 * 2 * 2 * 2  # channels · temporal_patch_size · patch_size²


def make_tower(seed: int = 0, depth: int = 2) -> Qwen3_5MoeVisionModel:
    """depth blocks, hidden 32, patch 2, temporal patch 2, merge 2, out 32, 4×4 position grid."""
    torch.manual_seed(seed)
    config = Qwen3_5MoeVisionConfig(
        depth=depth,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=2,
        temporal_patch_size=2,
        spatial_merge_size=MERGE,
        out_hidden_size=32,
        num_position_embeddings=16,
    )
    config._attn_implementation = "sdpa"
    tower = Qwen3_5MoeVisionModel(config).float()
    # Position embeddings start at zero in some inits; random values make them matter.
    with torch.no_grad():
        for p in tower.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return tower


def vision_fn(tower: Qwen3_5MoeVisionModel):
    """Adapt the tower's output dataclass to merged tokens [N_tokens, out_hidden_size]."""

    def run(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return tower(pixel_values, grid_thw).pooler_output

    return run


def make_batch(
    grid: list[tuple[int, int, int]], seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values [sum(t·h·w), PIXEL_WIDTH] and grid_thw [n, 3] (int64)."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grid)
    return torch.randn(rows, PIXEL_WIDTH, generator=gen), torch.tensor(grid, dtype=torch.int64)


def param_grads(tower: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in tower.named_parameters()}
