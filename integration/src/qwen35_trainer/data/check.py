"""``qwen35-train data check``'s report: a recipe's dataset (its first ``limit`` rows) read
through the run's own loader (:class:`~qwen35_trainer.data.loader.DataStream`, one process,
every shard, one pass, bad rows skipped and listed), so the packed rows and their fill are the
run's: samples, images, videos and the frames sampled from them, tokens, the packed rows, the
samples over capacity, and every bad row with its reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from qwen35_trainer.data.loader import DataStream
from qwen35_trainer.data.rows import open_rows
from qwen35_trainer.parallel import Layout

__all__ = ["DataReport", "check_dataset"]


@dataclasses.dataclass(frozen=True)
class DataReport:
    """What a run would get from the dataset."""

    path: str
    processor: str
    rows_read: int
    rows_total: int
    samples: int
    images: int
    frames_per_video: list[int]
    tokens: int
    longest: int
    trained_tokens: int
    packed_rows: int
    over_capacity: int
    bad_rows: list[str]
    data: Any  # the recipe's data section

    def lines(self) -> list[str]:
        data, capacity = self.data, self.data.pack_length
        frames = self.frames_per_video
        lines = [
            f"dataset     {self.path} ({self.rows_read} of {self.rows_total} rows read)",
            f"processor   {self.processor}",
            f"samples     {self.samples} good, {len(self.bad_rows)} bad",
            f"media       {self.images} images, {len(frames)} videos"
            + (f" ({min(frames)}-{max(frames)} frames sampled)" if frames else ""),
        ]
        if self.samples:
            lines.append(
                f"tokens      {self.tokens} (mean {self.tokens / self.samples:.1f}, "
                f"max {self.longest}), {self.trained_tokens} trained "
                f"(data.train_on={data.train_on})"
            )
        fill = self.tokens / (self.packed_rows * capacity) if self.packed_rows else 0
        lines += [
            f"packed rows {self.packed_rows} of {capacity} tokens, fill {fill:.3f} "
            f"(data.global_batch={data.rows_per_step(1)} rows per step, the loader's packing)",
            f"over capacity {self.over_capacity} (data.over_capacity={data.over_capacity})",
        ]
        return lines + [f"bad row     {message}" for message in self.bad_rows]


def check_dataset(recipe: Any, config: Any, limit: int | None = None) -> DataReport:
    """Read ``recipe``'s dataset (``config``: the model's) as a run would and report it."""
    data = recipe.data
    if not data.path:
        raise ValueError("data check needs data.path (a data.source iterable is the user's code)")
    path = data.path
    total = len(open_rows(path, data.split, data.subset_of(False)))
    count = total if limit is None else min(limit, total)
    checked = dataclasses.replace(recipe, data=dataclasses.replace(data, on_bad_row="skip"))
    stream = DataStream(
        checked,
        config,
        Layout(),
        torch.device("cpu"),
        limit=count,
        max_skipped=None,
        log_skipped=False,  # the report lists them, once
    )
    docs, rows, over = [], 0, 0
    while True:
        step = stream.next_step()
        found = [row for row in step.rows if row]
        if not found and not step.skipped and not step.truncated + step.dropped:
            break
        rows += len(found)
        docs += [doc for row in found for doc in row]
        over += step.truncated + step.dropped
    temporal = config.vision_config.temporal_patch_size
    return DataReport(
        path=str(path),
        processor=str(data.processor),
        rows_read=count,
        rows_total=total,
        samples=len(docs),
        images=sum(len(d.image_grid_thw) for d in docs),
        frames_per_video=[int(t) * temporal for d in docs for t in d.video_grid_thw[:, 0]],
        tokens=sum(len(d) for d in docs),
        longest=max((len(d) for d in docs), default=0),
        trained_tokens=sum(int((d.labels >= 0).sum()) for d in docs),
        packed_rows=rows,
        over_capacity=over,
        bad_rows=list(stream.skipped),
        data=data,
    )
