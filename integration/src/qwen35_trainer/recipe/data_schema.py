"""The recipe's ``data`` section (:class:`DataRecipe`): which rows, read how, packed how, and its
derivations (``rows_per_step``); every bad value reported in one ``ValueError``."""

from __future__ import annotations

import dataclasses
from typing import Any

from qwen35_trainer.recipe.rules import refuse

__all__ = ["ON_BAD_ROW", "OVER_CAPACITY", "TRAIN_ON", "DataRecipe"]


@dataclasses.dataclass(frozen=True)
class DataRecipe:
    """What the model trains on: a conversation dataset (``path`` or ``source``) or, without
    one, the seeded synthetic stream.

    Dataset (:mod:`qwen35_trainer.data.loader`): ``path`` a JSONL / Parquet file of
    ``messages`` rows (or a folder ``datasets`` loads, with ``split``), or ``source`` a
    ``"package.module:callable"`` returning an iterable of such rows (imported and called: a
    recipe that names one runs that code); ``processor`` the
    transformers processor directory (``builtin:demo/...`` paths name the demo dataset,
    :mod:`qwen35_trainer.demo.dataset`, written on first use; the built recipe holds its local
    paths); ``eval_path`` / ``eval_split`` the
    held-out rows; ``train_on`` ``assistant`` (every assistant turn as the full rendering
    shows it), ``last_assistant`` (the turns after the last user query) or ``all`` (every text
    token); ``chat_template_kwargs`` reach the chat template (e.g. ``enable_thinking: false``,
    Qwen3.6's ``preserve_thinking: true``); ``global_batch`` packed rows of
    ``pack_length`` tokens per step (``None``: one per data-parallel rank); ``over_capacity``
    ``truncate`` or ``drop``; ``on_bad_row`` ``raise`` or ``skip``; ``workers`` / ``prefetch``
    loader processes and documents each reads ahead; ``shuffle`` each epoch (seeded by
    ``seed``); ``video_fps`` / ``max_frames`` override the processor's frame sampling;
    ``frames_fps`` the rate of videos given as frame lists without their own ``fps``.

    Hugging Face Hub (:mod:`qwen35_trainer.recipe.hub`): ``path`` / ``eval_path`` may name a
    dataset repository and ``processor`` a model repository (``org/name``, when no local path
    of that name exists), read at ``revision`` / ``eval_revision`` / ``processor_revision`` (a
    branch, tag or commit; ``None``: ``main``, or, for a repository named twice, the first
    one's: ``eval_path`` = ``path``, ``processor`` = ``model.path``); each resolves to its
    snapshot folder when the recipe is built and ``from_hub`` records ``key: org/name@revision``.
    ``subset`` / ``eval_subset``: the subset (``datasets``' config ``name``) of a dataset
    folder or repository, as its README's ``configs`` define it (``eval_subset`` ``None``:
    ``subset`` when ``eval_path`` is ``path``).

    Synthetic: text tokens around ``images_per_sample`` images whose patch grids [t, h, w] are
    drawn from ``image_grids``; ``samples_per_rank`` per rank and step, as right-padded rows,
    or with ``packing`` as ONE row of concatenated documents kept apart in every layer
    (:mod:`qwen35_trainer.data.packing`). ``packing`` unset (``null``): true with a dataset
    (whose rows are always packed), false for the synthetic stream. ``text_only``: ``[period, count]`` — the last
    ``count`` of every ``period`` samples carry no image (text-only rows). ``pack_length``: the
    capacity of a packed row in tokens (the planner's sequence length; a longer synthetic row
    is refused); ``None``: as long as its documents."""

    samples_per_rank: int = 2
    packing: bool | None = None
    text_tokens: tuple[int, int] = (8, 24)
    image_grids: tuple[tuple[int, int, int], ...] = ((1, 4, 4),)
    images_per_sample: int = 1
    text_only: tuple[int, int] | None = None
    seed: int = 0
    pack_length: int | None = None
    path: str | None = None
    split: str = "train"
    subset: str | None = None
    revision: str | None = None
    source: str | None = None
    processor: str | None = None
    processor_revision: str | None = None
    eval_path: str | None = None
    eval_split: str = "train"
    eval_subset: str | None = None
    eval_revision: str | None = None
    from_hub: dict[str, str] = dataclasses.field(default_factory=dict)
    train_on: str = "assistant"
    global_batch: int | None = None
    over_capacity: str = "truncate"
    on_bad_row: str = "raise"
    workers: int = 0
    prefetch: int = 2
    shuffle: bool = True
    video_fps: float | None = None
    max_frames: int | None = None
    frames_fps: float = 2.0
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def dataset(self) -> bool:
        """Whether the run reads a conversation dataset (else the synthetic stream)."""
        return bool(self.path or self.source)

    def subset_of(self, eval: bool) -> str | None:
        """The subset the training (or, ``eval``, the held-out) rows are read with."""
        if not eval or self.eval_subset is not None:
            return self.eval_subset if eval else self.subset
        return self.subset if self.eval_path == self.path else None

    def rows_per_step(self, dp: int) -> int:
        """Packed rows per step over all ranks (``global_batch``, a multiple of ``dp``)."""
        rows = dp if self.global_batch is None else self.global_batch
        if rows % dp:
            raise ValueError(
                f"data.global_batch={rows} must be a multiple of the {dp} "
                "data-parallel ranks (each takes the same number of rows)"
            )
        return rows

    def __post_init__(self) -> None:
        lo, hi = self.text_tokens
        dataset = self.dataset
        if self.packing is None:  # a dataset's rows are packed; synthetic ones right-padded
            object.__setattr__(self, "packing", dataset)
        refuse(
            "data",
            {
                "samples_per_rank": (self.samples_per_rank >= 1, ">= 1"),
                "text_tokens": (1 <= lo <= hi, "[lo, hi] with 1 <= lo <= hi"),
                "images_per_sample": (self.images_per_sample >= 0, ">= 0"),
                "image_grids": (
                    bool(self.image_grids) and all(min(g) >= 1 for g in self.image_grids),
                    "a non-empty list of [t, h, w] with every entry >= 1",
                ),
                "pack_length": (
                    (self.pack_length is None and not dataset)
                    or (
                        self.pack_length is not None
                        and self.pack_length >= 8
                        and (not dataset or self.pack_length % 8 == 0)
                    ),
                    "a multiple of 8 tokens (>= 8) with a dataset, else >= 8 or null",
                ),
                "text_only": (
                    self.text_only is None
                    or (0 <= self.text_only[1] <= self.text_only[0] and self.text_only[0] >= 1),
                    "[period, count] with 0 <= count <= period, or null",
                ),
                "source": (
                    not (self.path and self.source),
                    "null when data.path is set (one of them)",
                ),
                "processor": (
                    bool(self.processor) or not dataset,
                    "a processor directory when data.path or data.source is set",
                ),
                "packing": (self.packing or not dataset, "true with a dataset (rows are packed)"),
                "train_on": (self.train_on in TRAIN_ON, f"one of {TRAIN_ON}"),
                "global_batch": (
                    self.global_batch is None or self.global_batch >= 1,
                    ">= 1 or null",
                ),
                "over_capacity": (self.over_capacity in OVER_CAPACITY, f"one of {OVER_CAPACITY}"),
                "on_bad_row": (self.on_bad_row in ON_BAD_ROW, f"one of {ON_BAD_ROW}"),
                "workers": (self.workers >= 0, ">= 0"),
                "prefetch": (self.prefetch >= 1, ">= 1"),
                "video_fps": (self.video_fps is None or self.video_fps > 0, "> 0 or null"),
                "max_frames": (self.max_frames is None or self.max_frames >= 1, ">= 1 or null"),
                "frames_fps": (self.frames_fps > 0, "> 0"),
            },
            self,
        )


TRAIN_ON = ("assistant", "last_assistant", "all")
OVER_CAPACITY = ("truncate", "drop")
ON_BAD_ROW = ("raise", "skip")
