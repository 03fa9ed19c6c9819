"""A conversation dataset as this rank's packed rows per step: deterministic, the same global
step under every layout, sharded over the data-parallel ranks, resumable, read ahead by worker
processes.

The global stream: position ``g`` is row ``order_e[g mod N]`` of epoch ``e = g // N``, with
``order_e`` a permutation seeded by ``(data.seed, e)`` (the file's order with
``data.shuffle: false``); a ``data.source`` iterable is read in its order, again from the start
after it ends.

Shards: a step has ``R = data.global_batch`` rows and the stream is dealt into ``R`` shards,
shard ``s`` holding positions ``s, s + R, s + 2R, …``; row ``s`` of every step is filled from
shard ``s`` alone, in order, up to ``data.pack_length`` tokens: the first document that does not
fit ends the row and opens the shard's row of the next step. Data-parallel rank ``k`` of ``dp``
owns shards ``k R/dp … (k+1) R/dp - 1``. So the step's rows do not depend on the layout: one
process reads all ``R`` shards and trains on the same rows as ``dp`` ranks together, which is
what makes every layout comparable with one process; and each document is read by one data
rank only. A rank's documents are encoded (processor, media, M-RoPE positions) in position
order, the ``t``-th by worker ``t mod W``; torch's DataLoader returns the workers' results in that
round-robin order, so nothing depends on ``data.workers``.

The loader's whole state is, per shard, the index ``j`` of its first unused document (the
cursor). A checkpoint stores every shard's cursor; a resumed run re-encodes from there and packs
exactly the rows the uninterrupted run packs — with any data parallelism that divides ``R``.

Documents longer than ``pack_length`` follow ``data.over_capacity``: ``truncate`` keeps the
longest prefix that does not cut a picture or video apart (media after the cut are dropped with
their placeholders), ``drop`` leaves the document out; both are counted in the step's metrics and
logged with the row's name. Bad rows (:class:`~qwen35_trainer.data.conversation.DataError`)
raise under ``data.on_bad_row: raise`` and are counted and logged under ``skip``. Every rank
builds its step first, then all agree (one all-reduce on the group's device) whether any rank
failed: then every rank raises — the failing ranks with their message, the others naming them —
so a bad row never leaves the other ranks waiting in a collective.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import multiprocessing
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from qwen35_trainer.data.batch import IGNORE_INDEX, Sample
from qwen35_trainer.data.conversation import ConversationEncoder, DataError
from qwen35_trainer.data.sources import RankDocuments

__all__ = ["DataStream", "StepData", "truncate"]

logger = logging.getLogger("qwen35_trainer")
MAX_SKIPPED_PER_STEP = 1000


@dataclasses.dataclass
class StepData:
    """This rank's rows of one step and the step's global data counts."""

    rows: list[list[Sample]]
    tokens: int = 0  # document tokens in the step's rows (all ranks)
    capacity: int = 0  # rows × pack_length (all ranks)
    truncated: int = 0
    dropped: int = 0
    skipped: int = 0

    @property
    def fill(self) -> float:
        return self.tokens / self.capacity if self.capacity else 0.0


def truncate(sample: Sample, capacity: int, config: Any) -> Sample | None:
    """The longest prefix of at most ``capacity`` tokens that cuts no picture or video apart;
    media after the cut go with their placeholders. ``None`` when nothing trainable is left."""
    from cp_varlen_attn import mrope_positions

    mm = sample.mm_token_type_ids
    cut = capacity
    spans = _media_spans(mm, sample)
    for start, end, _, _ in spans:
        if start < cut < end:
            cut = start
    kept_images = sum(1 for s, e, kind, _ in spans if kind == 1 and e <= cut)
    kept_videos = sum(1 for s, e, kind, _ in spans if kind == 2 and e <= cut)
    labels = sample.labels[:cut]
    if (labels[1:] == IGNORE_INDEX).all():
        return None
    images, videos = sample.image_grid_thw[:kept_images], sample.video_grid_thw[:kept_videos]
    out = Sample(
        input_ids=sample.input_ids[:cut],
        labels=labels,
        mm_token_type_ids=mm[:cut],
        pixel_values=sample.pixel_values[: int(images.prod(-1).sum())],
        image_grid_thw=images,
        pixel_values_videos=sample.pixel_values_videos[: int(videos.prod(-1).sum())],
        video_grid_thw=videos,
        source=sample.source,
    )
    out.position_ids = mrope_positions(config, out.input_ids, out.mm_token_type_ids, images, videos)
    return out


def _media_spans(mm: torch.Tensor, sample: Sample) -> list[tuple[int, int, int, int]]:
    """``(start, end, kind, index)`` token span of every image (kind 1) and video (kind 2); a
    video's span covers all its frames (one run per frame)."""
    runs = []
    for kind, group in itertools.groupby(enumerate(mm.tolist()), key=lambda x: x[1]):
        if kind:
            group = list(group)
            runs.append((group[0][0], group[-1][0] + 1, kind))
    spans, frames = [], sample.video_grid_thw[:, 0].tolist()
    image = video = 0
    pending = None
    for start, end, kind in runs:
        if kind == 1:
            spans.append((start, end, 1, image))
            image += 1
            continue
        if pending is None:
            pending = [start, end, frames[video] if video < len(frames) else 1]
        pending[1] = end
        pending[2] -= 1
        if pending[2] == 0:
            spans.append((pending[0], pending[1], 2, video))
            video, pending = video + 1, None
    return spans


class DataStream:
    """This rank's packed rows, step after step (see the module docstring). ``layout``: the
    parallel layout (its data-parallel index and size); ``eval``: the held-out stream
    (``data.eval_path``, in file order, from its start); ``limit``: read only the stream's
    first ``limit`` positions (one pass over them: ``data check``; the rows then end, and the
    steps after are empty); ``max_skipped``: bad rows one step may skip before it fails
    (``None``: no limit); ``log_skipped``: log each skipped bad row (they are also kept in
    :attr:`skipped`)."""

    def __init__(
        self,
        recipe: Any,
        config: Any,
        layout: Any,
        device: torch.device,
        *,
        eval: bool = False,
        limit: int | None = None,
        max_skipped: int | None = MAX_SKIPPED_PER_STEP,
        log_skipped: bool = True,
    ) -> None:
        data = recipe.data
        self.data, self.layout, self.device = data, layout, device
        self.encoder = ConversationEncoder.from_recipe(data, recipe.model, config)
        self.encoder.check_template()  # the same verdict on every rank, before any collective
        self.reading = {
            "path": data.eval_path if eval else data.path,
            "source": None if eval else data.source,
            "split": data.eval_split if eval else data.split,
            "subset": data.subset_of(eval),
            "shuffle": data.shuffle and not eval,
            "seed": data.seed,
            "limit": limit,
        }
        self.max_skipped, self.log_skipped = max_skipped, log_skipped
        self.skipped: list[str] = []  # the bad rows skipped so far (data.on_bad_row: skip)
        dp = layout.data_groups
        self.shard_count = data.rows_per_step(dp)
        per_rank = self.shard_count // dp
        self.shards = list(range(layout.data_group * per_rank, (layout.data_group + 1) * per_rank))
        self.next_j = dict.fromkeys(self.shards, 0)  # per shard: the next document to read
        self._pending: dict[int, collections.deque] = {s: collections.deque() for s in self.shards}
        self._iterator = None

    @property
    def cursors(self) -> dict[int, int]:
        """Per owned shard: the index of its first document not yet in a row."""
        return {
            s: self._pending[s][0][0] if self._pending[s] else self.next_j[s] for s in self.shards
        }

    def state_dict(self) -> dict:
        return {"shards": self.shard_count, "cursors": self.cursors}

    def load_state_dict(self, state: dict) -> None:
        if state["shards"] != self.shard_count:
            raise ValueError(
                f"the data state has {state['shards']} shards (data.global_batch "
                f"then), this run {self.shard_count}: resume with the same "
                "data.global_batch"
            )
        self.next_j = {s: int(state["cursors"][s]) for s in self.shards}
        self._pending = {s: collections.deque() for s in self.shards}
        self._iterator = None

    def _read(self) -> tuple[int, int, Sample | DataError]:
        if self._iterator is None:
            docs = RankDocuments(
                self.reading, self.encoder, self.shards, self.shard_count, dict(self.next_j)
            )
            workers = self.data.workers
            if workers and multiprocessing.current_process().daemon:
                logger.warning(
                    "data.workers=%d: this process is a daemon (it may not start "
                    "processes), so the documents are read in it",
                    workers,
                )
                workers = 0
            loader = DataLoader(
                docs,
                batch_size=None,
                num_workers=workers,
                prefetch_factor=self.data.prefetch if workers else None,
                collate_fn=_identity,
            )
            self._iterator = iter(loader)
        return next(self._iterator)

    def next_step(self) -> StepData:
        """This rank's rows of the next step, in shard order (every rank calls it: the ranks
        agree on errors and sum the counts)."""
        capacity = self.data.pack_length
        rows = {s: [] for s in self.shards}
        room = dict.fromkeys(self.shards, capacity)
        open_ = set(self.shards)
        counts = {"truncated": 0, "dropped": 0, "skipped": 0}
        error = None
        while open_ and error is None:
            waiting = [s for s in sorted(open_) if self._pending[s]]
            if not waiting:  # every open row waits for its shard's next document
                try:
                    read = self._read()
                except StopIteration:  # past ``limit``: the rows end here
                    break
                except (DataError, OSError) as failed:  # the file itself: agreed like a row
                    error = str(failed)
                    break
                error = self._take(read, counts)
                continue
            for s in waiting:
                item = self._pending[s][0][1]
                if len(item) <= room[s]:
                    rows[s].append(item)
                    room[s] -= len(item)
                    self._pending[s].popleft()
                else:
                    open_.discard(s)
        tokens = sum(len(d) for row in rows.values() for d in row)
        totals = self._agree(
            error,
            [
                tokens,
                capacity * len(self.shards),
                counts["truncated"],
                counts["dropped"],
                counts["skipped"],
            ],
        )
        return StepData([rows[s] for s in self.shards], *totals)

    def _take(self, read: tuple[int, int, Any], counts: dict[str, int]) -> str | None:
        """File a document read from shard ``s`` for its row (bad rows and documents over
        capacity by the policies); the error message under ``on_bad_row: raise``."""
        shard, j, item = read
        self.next_j[shard] = j + 1
        if isinstance(item, DataError):
            if self.data.on_bad_row == "raise":
                self.next_j[shard] = j  # not consumed: a resumed run meets it again
                return str(item)
            if self.log_skipped:
                logger.warning("skipping a bad row: %s", item)
            counts["skipped"] += 1
            self.skipped.append(str(item))
            if self.max_skipped is not None and counts["skipped"] > self.max_skipped:
                return f"more than {self.max_skipped} bad rows in one step; last: {item}"
            return None
        capacity = self.data.pack_length
        if len(item) > capacity:
            kept = None
            if self.data.over_capacity == "truncate":
                kept = truncate(item, capacity, self.encoder.config)
            what = "truncated" if kept is not None else "dropped"
            logger.warning(
                "%s: %d tokens, more than data.pack_length=%d: %s",
                item.source,
                len(item),
                capacity,
                what,
            )
            counts[what] += 1
            if kept is None:
                return None
            item = kept
        self._pending[shard].append((j, item))
        return None

    def _agree(self, error: str | None, counts: list[int]) -> list[int]:
        """The step's counts summed over the data ranks, after every rank learnt whether any
        rank failed (then all raise)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            if error:
                raise DataError(error)
            return counts
        world, rank = dist.get_world_size(), dist.get_rank()
        flags = torch.zeros(world + len(counts), dtype=torch.long, device=self.device)
        flags[rank] = int(error is not None)
        flags[world:] = torch.tensor(counts, device=self.device)
        dist.all_reduce(flags)
        failed = flags[:world].nonzero().flatten().tolist()
        if error:
            raise DataError(error)
        if failed:
            raise DataError(f"bad data on rank(s) {failed} (their error names the file and row)")
        # the CP / TP peers of a data-parallel rank read the same rows: count each group once
        return (flags[world:] // (world // self.layout.data_groups)).tolist()


def _identity(x):
    return x
