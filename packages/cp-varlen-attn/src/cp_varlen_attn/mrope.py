"""Multimodal RoPE positions of one Qwen3.5 document from the model config alone.

:func:`mrope_positions` needs no model object (data-loader workers call it) and no transformers
import: only ``config.vision_config.spatial_merge_size``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["mrope_positions", "spatial_merge_size"]

TEXT, IMAGE, VIDEO = 0, 1, 2


def spatial_merge_size(config: Any) -> int:
    """``config.vision_config.spatial_merge_size`` (the VLM config, or anything holding a vision
    config); ``TypeError`` when there is none."""
    vision = getattr(config, "vision_config", None)
    if isinstance(vision, dict):
        merge = vision.get("spatial_merge_size")
    else:
        merge = getattr(vision, "spatial_merge_size", None)
    if merge is None:
        raise TypeError(
            f"{type(config).__name__} has no vision_config.spatial_merge_size: pass the VLM's config "
            "(e.g. model.config of a Qwen3.5 *ForConditionalGeneration)"
        )
    merge = int(merge)
    if merge < 1:
        raise ValueError(f"vision_config.spatial_merge_size must be >= 1, got {merge}")
    return merge


def _grids(grid_thw: Any, name: str) -> list[tuple[int, int, int]]:
    if grid_thw is None:
        return []
    grid = torch.as_tensor(grid_thw)
    if grid.numel() == 0:
        return []
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point():
        raise ValueError(
            f"{name} must be an integer [N, 3] tensor of (t, h, w), got {tuple(grid.shape)}"
        )
    rows = [tuple(int(v) for v in r) for r in grid.tolist()]
    for i, r in enumerate(rows):
        if min(r) < 1:
            raise ValueError(f"{name}[{i}] = {list(r)}: every extent must be >= 1")
    return rows


def mrope_positions(
    config: Any,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
) -> torch.Tensor:
    """[3, L] (temporal, height, width) M-RoPE positions of ONE document, as long integers.

    ``input_ids`` and ``mm_token_type_ids`` [L] (0 text, 1 image, 2 video); ``image_grid_thw`` /
    ``video_grid_thw`` [N, 3], one row per image / video of the document, in order; ``config``
    the VLM config (``config.vision_config.spatial_merge_size`` = ``m`` is all that is read).

    Each maximal run of equal ``mm_token_type_ids`` is one segment. With a counter ``p`` from 0:

    - a text run of ``n`` tokens gets ``p, p+1, …, p+n-1`` on all three axes; ``p += n``;
    - an image run takes the next image grid ``(t, h, w)``; a video run the next video FRAME:
      each video grid ``(t, h, w)`` counts as ``t`` grids ``(1, h, w)``, because Qwen3.5's
      processor writes every frame as its own run (``<timestamp text> <vision_start> <video
      pads> <vision_end>``). Its ``t·(h/m)·(w/m)`` tokens, in (frame, row, column) order, get
      temporal ``p + frame``, height ``p + row``, width ``p + column``; then ``p += max(h, w) // m``
      (the temporal extent does not advance ``p``).

    Refused (``ValueError``, saying what was expected and what came): ids / types not 1-D or of
    different lengths, a type other than 0 / 1 / 2, a grid extent not a multiple of ``m``, more
    image runs or video-frame runs than grids or fewer, and a run whose length is not its grid's
    ``t·h·w / m²`` tokens.

    Why this equals transformers' ``Qwen3_5[Moe]Model.get_rope_index(ids[None], types[None],
    image_grid_thw=…, video_grid_thw=…)[0][:, 0]`` (5.2–5.24) on every document it accepts:
    ``get_rope_index`` (i) replaces each video grid row by ``t`` rows ``(1, h, w)``
    (``repeat_interleave`` then ``[:, 0] = 1``) — the split above, in the same order; (ii) groups
    the types into maximal equal runs (``itertools.groupby``) — the same runs
    (``unique_consecutive``); (iii) walks them with ``current_pos`` from 0: text gets
    ``arange(n) + current_pos`` and advances by ``n``; a vision run takes ``next()`` of ITS
    modality's iterator, so images and video frames are consumed in order independently, as here;
    its positions are ``get_vision_position_ids(current_pos, grid, 1, m)``: a
    ``meshgrid(ij)`` of ``arange(t)·1.0`` (``time_interval`` 1.0, cast to long: ``arange(t)``),
    ``arange(h // m) + p`` and ``arange(w // m) + p``, flattened in (t, h, w) order, with ``p``
    added to the temporal axis afterwards — the same integers in the same order; then it advances
    by ``max(h, w) // m``. Every step is the same integer function of (``p``, grid), so the
    outputs agree element for element. The checks only refuse inputs ``get_rope_index`` mishandles
    (a run longer or shorter than its grid gives a wrongly sized result or a shape error there;
    unused grids are silently ignored there) — they never change an accepted result.
    """
    merge = spatial_merge_size(config)
    ids = torch.as_tensor(input_ids)
    types = torch.as_tensor(mm_token_type_ids)
    if ids.dim() != 1 or types.dim() != 1:
        raise ValueError(
            "input_ids and mm_token_type_ids must be 1-D (one document), got "
            f"{tuple(ids.shape)} and {tuple(types.shape)}"
        )
    if ids.shape != types.shape:
        raise ValueError(
            f"input_ids has {ids.numel()} tokens but mm_token_type_ids {types.numel()}"
        )
    device = ids.device
    images = _grids(image_grid_thw, "image_grid_thw")
    frames = [(1, h, w) for t, h, w in _grids(video_grid_thw, "video_grid_thw") for _ in range(t)]
    for name, grids in (("image_grid_thw", images), ("video_grid_thw", frames)):
        for t, h, w in grids:
            if h % merge or w % merge:
                raise ValueError(
                    f"{name} has a grid (t, h, w) = {(t, h, w)} whose h and w are not multiples "
                    f"of spatial_merge_size {merge}"
                )
    if ids.numel() == 0:
        if images or frames:
            raise ValueError(
                f"an empty document has no vision runs, but {len(images)} image grids and "
                f"{len(frames)} video frames came"
            )
        return torch.zeros(3, 0, dtype=torch.long, device=device)
    kinds, counts = torch.unique_consecutive(types.to(torch.long), return_counts=True)
    queues = {IMAGE: ("image", images), VIDEO: ("video frame", frames)}
    used = {IMAGE: 0, VIDEO: 0}
    pieces: list[torch.Tensor] = []
    p = 0
    for kind, n in zip(kinds.tolist(), counts.tolist(), strict=True):
        if kind == TEXT:
            pieces.append(torch.arange(p, p + n, device=device).expand(3, n))
            p += n
            continue
        if kind not in queues:
            raise ValueError(
                f"mm_token_type_ids holds {kind}; expected 0 (text), 1 (image) or 2 (video)"
            )
        what, grids = queues[kind]
        k = used[kind]
        if k == len(grids):
            raise ValueError(
                f"{what} run {k} ({n} tokens) has no grid: {len(grids)} {what} grids came "
                "(each video grid (t, h, w) counts as t frames)"
            )
        t, h, w = grids[k]
        used[kind] = k + 1
        gh, gw = h // merge, w // merge
        if n != t * gh * gw:
            raise ValueError(
                f"{what} run {k} has {n} tokens, but its grid (t, h, w) = {(t, h, w)} with "
                f"spatial_merge_size {merge} expects t*h*w/m^2 = {t * gh * gw}"
            )
        temporal = torch.arange(t, device=device).repeat_interleave(gh * gw)
        height = torch.arange(gh, device=device).repeat_interleave(gw).repeat(t)
        width = torch.arange(gw, device=device).repeat(t * gh)
        pieces.append(torch.stack([temporal, height, width]) + p)
        p += max(h, w) // merge
    for kind, (what, grids) in queues.items():
        if used[kind] != len(grids):
            raise ValueError(
                f"{len(grids)} {what} grids came but the document has {used[kind]} {what} runs "
                "(each video grid (t, h, w) counts as t frames, each its own run)"
            )
    return torch.cat(pieces, dim=1)
