"""Which frames of a vision batch each context-parallel rank encodes.

Units. A Qwen-VL-style tower attends only inside one temporal frame (its ``cu_seqlens`` repeat
``h·w`` for each of the ``t`` frames of a grid row) and its position embeddings are spatial, so
every frame is an independent unit of work: an image (``t == 1``) is one unit, a video with
``t`` temporal patch groups is ``t`` units. ``pixel_values`` holds each frame's ``h·w`` patch rows
contiguously, grid rows in order and frames in order inside a row, and the merger turns each
frame's rows into ``h·w / m²`` consecutive output tokens (``m`` = spatial merge size). Hence a
contiguous range of units owns a contiguous range of pixel rows and a contiguous range of
output tokens, and concatenating the ranks' outputs in rank order gives the full output.

Cost. A frame of ``p`` patches costs ``p·(p + α)`` per block, up to a constant: attention is
``4·p²·d`` FLOPs (QKᵀ and AV) and the per-patch linear work (qkv, proj, MLP) is
``p·(8·d² + 4·d·I)``; their sum is ``4·d·p·(p + 2·d + I)``. So ``α = 2·hidden + intermediate``
makes the cost exactly proportional to the blocks' FLOPs; :data:`DEFAULT_COST_ALPHA` is that
number for the Qwen3.5 vision tower (hidden 1152, intermediate 4304).

Cut. The units are split into one contiguous range per rank minimising the largest range cost
(the linear-partition problem), exactly, by dynamic programming over prefixes:
``best[k][j] = min_i max(best[k-1][i], S[j] - S[i])``. ``best[k-1][i]`` never decreases in ``i``
and ``S[j] - S[i]`` never increases, so the minimum sits where the two cross; that crossing only
moves right as ``j`` grows, so one pointer per ``k`` finds it: O(ranks · units) in all. Every
range is non-empty when there are at least as many units as ranks (splitting a range never
raises the maximum, so this costs nothing). With fewer units than ranks, the first ranks get
one unit each and the rest get a dummy frame of the smallest valid grid ``(1, m, m)`` whose one
output token is dropped after the gather.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

__all__ = ["DEFAULT_COST_ALPHA", "FramePlan", "plan_frames"]

DEFAULT_COST_ALPHA = 2 * 1152 + 4304
"""``2·hidden_size + intermediate_size`` of the Qwen3.5 vision tower (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class FramePlan:
    """A contiguous assignment of frames to ranks; every range is half-open ``(start, end)``.

    Attributes:
        grid_thw: the global grid rows ``(t, h, w)``, in order.
        world_size: number of ranks the plan is for.
        spatial_merge_size: ``m``; a frame of ``h·w`` patches yields ``h·w / m²`` tokens.
        cost_alpha: ``α`` of the unit cost ``p·(p + α)``.
        unit_costs: cost of every unit (frame) in global order.
        unit_ranges: per rank, the range of global units it encodes (empty for dummy ranks).
        pixel_ranges: per rank, its rows of ``pixel_values`` (empty for dummy ranks).
        token_ranges: per rank, its rows of the merged output (empty for dummy ranks).
        local_grids: per rank, the grid rows it passes to the tower: consecutive frames of one
            video merged into one row ``(frames, h, w)``; a dummy rank has ``((1, m, m),)``.
    """

    grid_thw: tuple[tuple[int, int, int], ...]
    world_size: int
    spatial_merge_size: int
    cost_alpha: float
    unit_costs: tuple[float, ...]
    unit_ranges: tuple[tuple[int, int], ...]
    pixel_ranges: tuple[tuple[int, int], ...]
    token_ranges: tuple[tuple[int, int], ...]
    local_grids: tuple[tuple[tuple[int, int, int], ...], ...]

    @property
    def num_units(self) -> int:
        return len(self.unit_costs)

    @property
    def num_pixel_rows(self) -> int:
        return sum(t * h * w for t, h, w in self.grid_thw)

    @property
    def num_tokens(self) -> int:
        m2 = self.spatial_merge_size**2
        return sum(t * h * w // m2 for t, h, w in self.grid_thw)

    def is_dummy(self, rank: int) -> bool:
        """True when ``rank`` has no real frame and encodes one dummy frame instead."""
        start, end = self.unit_ranges[rank]
        return start == end

    @property
    def dummy_grid(self) -> tuple[int, int, int]:
        m = self.spatial_merge_size
        return (1, m, m)

    def local_token_count(self, rank: int) -> int:
        """Rows ``rank``'s tower output has: its real tokens, or the dummy frame's one token."""
        if self.is_dummy(rank):
            return 1
        start, end = self.token_ranges[rank]
        return end - start

    @property
    def rank_costs(self) -> tuple[float, ...]:
        """Per rank, the summed cost of what it encodes (the dummy frame's cost on dummy ranks)."""
        m2 = self.spatial_merge_size**2
        dummy_cost = m2 * (m2 + self.cost_alpha)
        return tuple(
            dummy_cost if start == end else math.fsum(self.unit_costs[start:end])
            for start, end in self.unit_ranges
        )

    @property
    def replicated_cost(self) -> float:
        """What every rank encodes without sharding: the cost of all units."""
        return math.fsum(self.unit_costs)

    @property
    def imbalance(self) -> float:
        """``max / mean`` of :attr:`rank_costs`; 1.0 is perfect balance."""
        costs = self.rank_costs
        return max(costs) * len(costs) / math.fsum(costs)


def _as_grid(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> tuple[tuple[int, int, int], ...]:
    if isinstance(grid_thw, torch.Tensor):
        if grid_thw.dtype.is_floating_point or grid_thw.dtype.is_complex:
            raise TypeError(f"grid_thw must hold integers, got dtype {grid_thw.dtype}")
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(
                f"grid_thw must have shape [n_images_or_videos, 3], got {tuple(grid_thw.shape)}"
            )
        rows = grid_thw.tolist()
    else:
        rows = [list(r) for r in grid_thw]
        if any(len(r) != 3 or not all(isinstance(v, int) for v in r) for r in rows):
            raise TypeError(f"grid_thw must be rows of three ints (t, h, w), got {grid_thw!r}")
    if not rows:
        raise ValueError("grid_thw is empty: expected at least one image or video row")
    return tuple((int(t), int(h), int(w)) for t, h, w in rows)


def _min_max_cuts(costs: Sequence[float], parts: int) -> list[int]:
    """Cut points ``0 = b_0 < b_1 < ... < b_parts = n`` minimising the largest range sum.

    Needs ``n >= parts >= 1`` and non-negative costs; every range is non-empty.
    """
    n = len(costs)
    prefix = [0.0] * (n + 1)
    for i, c in enumerate(costs):
        prefix[i + 1] = prefix[i] + c
    inf = math.inf
    best = [inf, *prefix[1:]]  # one range over the first j units (j >= 1)
    choices: list[list[int]] = []
    for k in range(2, parts + 1):
        cur = [inf] * (n + 1)
        choice = [0] * (n + 1)
        i = k - 1  # last range is units [i, j); the first k-1 ranges cover [0, i)
        for j in range(k, n + 1):
            while i < j - 1 and best[i] < prefix[j] - prefix[i]:
                i += 1
            cur[j], choice[j] = max(best[i], prefix[j] - prefix[i]), i
            if i - 1 >= k - 1:
                alt = max(best[i - 1], prefix[j] - prefix[i - 1])
                if alt < cur[j]:
                    cur[j], choice[j] = alt, i - 1
        best = cur
        choices.append(choice)
    cuts = [n]
    for choice in reversed(choices):
        cuts.append(choice[cuts[-1]])
    cuts.append(0)
    return cuts[::-1]


def plan_frames(
    grid_thw: torch.Tensor | Sequence[Sequence[int]],
    world_size: int,
    *,
    cost_alpha: float = DEFAULT_COST_ALPHA,
    spatial_merge_size: int = 2,
) -> FramePlan:
    """Split the frames of a vision batch into one contiguous, cost-balanced range per rank.

    Args:
        grid_thw: ``[n_images_or_videos, 3]`` integer ``(t, h, w)`` patch grid per image/video,
            as the Qwen-VL processors emit it (a tensor or a sequence of triples).
        world_size: number of ranks sharing the work (``>= 1``).
        cost_alpha: ``α >= 0`` in the per-frame cost ``p·(p + α)`` for ``p = h·w`` patches;
            ``2·hidden_size + intermediate_size`` of the tower makes it proportional to FLOPs.
        spatial_merge_size: ``m``; ``h`` and ``w`` must be multiples of it.

    Returns:
        A :class:`FramePlan` whose largest rank cost is the smallest any contiguous cut achieves.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(spatial_merge_size, bool) or not isinstance(spatial_merge_size, int):
        raise TypeError(f"spatial_merge_size must be an int, got {spatial_merge_size!r}")
    if spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size must be >= 1, got {spatial_merge_size}")
    if not math.isfinite(cost_alpha) or cost_alpha < 0:
        raise ValueError(f"cost_alpha must be a finite number >= 0, got {cost_alpha!r}")
    grid = _as_grid(grid_thw)
    m = spatial_merge_size
    for row, (t, h, w) in enumerate(grid):
        if t < 1 or h < 1 or w < 1 or h % m or w % m:
            raise ValueError(
                f"grid_thw row {row} is {(t, h, w)}: expected t >= 1 and h, w positive "
                f"multiples of spatial_merge_size={m}"
            )

    # One entry per frame: (pixel rows, tokens, grid row it belongs to).
    frames = [
        (h * w, h * w // (m * m), row) for row, (t, h, w) in enumerate(grid) for _ in range(t)
    ]
    unit_costs = tuple(p * (p + cost_alpha) for p, _, _ in frames)
    n = len(frames)
    if n >= world_size:
        cuts = _min_max_cuts(unit_costs, world_size)
    else:
        cuts = list(range(n + 1)) + [n] * (world_size - n)
    unit_ranges = tuple((cuts[r], cuts[r + 1]) for r in range(world_size))

    pixel_starts, token_starts = [0], [0]
    for p, tok, _ in frames:
        pixel_starts.append(pixel_starts[-1] + p)
        token_starts.append(token_starts[-1] + tok)

    local_grids = []
    for start, end in unit_ranges:
        rows: list[list[int]] = []
        for u in range(start, end):
            row = frames[u][2]
            if rows and rows[-1][3] == row:
                rows[-1][0] += 1
            else:
                rows.append([1, grid[row][1], grid[row][2], row])
        local_grids.append(tuple((t, h, w) for t, h, w, _ in rows) or ((1, m, m),))

    return FramePlan(
        grid_thw=grid,
        world_size=world_size,
        spatial_merge_size=m,
        cost_alpha=float(cost_alpha),
        unit_costs=unit_costs,
        unit_ranges=unit_ranges,
        pixel_ranges=tuple((pixel_starts[s], pixel_starts[e]) for s, e in unit_ranges),
        token_ranges=tuple((token_starts[s], token_starts[e]) for s, e in unit_ranges),
        local_grids=tuple(local_grids),
    )
