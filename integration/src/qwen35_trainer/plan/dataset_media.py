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
the reading, and the plan says how many rows it read).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["DATA_ROWS", "DatasetMedia", "densest_micro_batch", "packed_row_grids"]

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
