"""The images and videos a dataset's run feeds the vision tower, read from the dataset itself:
the planner's tower (its activations, its FLOPs, CP's vision gather) counts them instead of
``data.image_grids``, which describe the synthetic stream's images only.

:func:`packed_row_grids` reads the first :data:`DATA_ROWS` rows of ``data.path`` through the
run's own loader (:class:`~qwen35_trainer.data.loader.DataStream` in one process, as
``qwen35-train data check`` does: the recipe's processor resizes each image and samples each
video's frames, bad rows skipped), packed as the run packs them, and gives each packed row's
patch grids ``[t, h, w]``. :func:`densest_micro_batch` then takes the ``k`` rows of one
micro-batch with the most patches among them: a plan's tower holds at least what the densest
micro-batch read brings (a later row with larger images is not seen: :data:`DATA_ROWS` bounds
the reading, and the plan says how many rows it read). A step's time is priced at the typical
micro-batch instead (:func:`typical_micro_batch`: the rows of median patches): the run's
steps average over its rows, while its memory must hold its densest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = [
    "DATA_ROWS",
    "DatasetMedia",
    "densest_micro_batch",
    "micro_rows",
    "packed_row_grids",
    "planned_images",
    "typical_micro_batch",
]

DATA_ROWS = 256  # dataset rows the planner reads for their images
_READ: dict[tuple, DatasetMedia] = {}  # what was read, per data section (a search plans many)


@dataclasses.dataclass(frozen=True)
class DatasetMedia:
    """Each packed row's patch grids ``[t, h, w]`` (images and videos) of the rows read."""

    path: str
    rows_read: int
    rows: tuple[tuple[tuple[int, int, int], ...], ...]


def packed_row_grids(recipe: Any, config: Any) -> DatasetMedia:
    """The packed rows of ``recipe``'s dataset (its first :data:`DATA_ROWS` rows) and their
    grids (module docstring); read once per process for the same data section."""
    from qwen35_trainer.data.loader import DataStream
    from qwen35_trainer.data.rows import open_rows
    from qwen35_trainer.parallel import Layout

    data = recipe.data
    key = (repr(data), repr(recipe.model))
    if key in _READ:
        return _READ[key]
    count = min(DATA_ROWS, len(open_rows(data.path, data.split, data.subset_of(False))))
    checked = dataclasses.replace(recipe, data=dataclasses.replace(data, on_bad_row="skip"))
    stream = DataStream(
        checked, config, Layout(), torch.device("cpu"), limit=count, max_skipped=None
    )
    rows = []
    while True:
        step = stream.next_step()
        found = [row for row in step.rows if row]
        if not found and not step.skipped and not step.truncated + step.dropped:
            break
        for row in found:
            grids = [g for doc in row for g in (*doc.image_grid_thw, *doc.video_grid_thw)]
            rows.append(tuple(tuple(int(v) for v in g) for g in grids))
    _READ[key] = DatasetMedia(str(data.path), count, tuple(rows))
    return _READ[key]


def densest_micro_batch(media: DatasetMedia, rows: int) -> tuple[tuple[int, int, int], ...]:
    """The grids of the ``rows`` packed rows with the most patches (one micro-batch's rows)."""
    ranked = sorted(media.rows, key=lambda grids: sum(t * h * w for t, h, w in grids))
    return tuple(g for grids in ranked[max(len(ranked) - rows, 0) :] for g in grids)


def typical_micro_batch(media: DatasetMedia, rows: int) -> tuple[tuple[int, int, int], ...]:
    """The grids of ``rows`` packed rows of median patches (a typical micro-batch's rows)."""
    ranked = sorted(media.rows, key=lambda grids: sum(t * h * w for t, h, w in grids))
    start = max((len(ranked) - rows) // 2, 0)
    return tuple(g for grids in ranked[start : start + rows] for g in grids)


def micro_rows(recipe) -> int:
    """A dataset's packed rows in one micro-batch of one data-parallel group."""
    groups = recipe.parallel.dp_replicate * recipe.parallel.dp
    return recipe.data.rows_per_step(groups) // groups // recipe.train.grad_accum_steps


def planned_images(recipe, config) -> tuple[tuple | None, str | None]:
    """``((held, priced), line)``: one micro-batch's image and video grids its memory holds
    and its step time is priced at, and what the plan says of them. A dataset at
    ``data.path``: the densest and a typical micro-batch of the rows read (module
    docstring); unreadable, or a ``data.source`` iterable: ``data.image_grids``, said so; the
    synthetic stream: its own images (``None``: :func:`.planner.micro_grids`)."""
    data = recipe.data
    if not data.dataset:
        return (None, None), None
    largest = list(max(data.image_grids, key=lambda g: g[0] * g[1] * g[2]))
    instead = f"planned as data.image_grids' largest {largest}, {data.images_per_sample} per sample"
    if not data.path:
        return (None, None), f"images: {instead} (a data.source iterable is not read)"
    try:
        media = packed_row_grids(recipe, config)
    except (OSError, ValueError) as err:
        return (None, None), f"images: {instead}: data.path could not be read ({err})"
    rows = micro_rows(recipe)
    grids, priced = densest_micro_batch(media, rows), typical_micro_batch(media, rows)
    patches, frames = sum(t * h * w for t, h, w in grids), sum(t for t, _, _ in grids)
    typical = sum(t * h * w for t, h, w in priced)
    return (grids, priced), (
        f"images: the densest micro-batch ({rows} packed rows) of the first "
        f"{media.rows_read} rows of {media.path}: {len(grids)} images / videos, {frames} "
        f"frames, {patches:,} patches (the step time: a typical one, {typical:,} patches)"
    )
