"""Where a rank's documents come from, in the global stream's order: a JSONL / JSON / Parquet
file (or a folder) read row by row (:mod:`qwen35_trainer.data.files`), or a
``data.source`` iterable (``"package.module:callable"``, imported and called — in the loader's
worker processes too — so a recipe naming one runs that code).

:class:`RankDocuments` yields this rank's shards' documents from their cursors on, in position
order (:mod:`qwen35_trainer.data.loader` has the stream's dealing rule), the ``t``-th of them
encoded by worker ``t mod W``; a bad row comes back as its
:class:`~qwen35_trainer.data.conversation.DataError` for the loader to count or raise.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from qwen35_trainer.data.conversation import ConversationEncoder, DataError
from qwen35_trainer.data.rows import open_rows

__all__ = ["RankDocuments"]


def _user_source(source: str):
    module, _, name = source.partition(":")
    if not module or not name:
        raise ValueError(f"data.source must be 'package.module:callable', got {source!r}")
    return getattr(importlib.import_module(module), name)


class RankDocuments(IterableDataset):
    """The documents of ``shards`` (of ``count``) from their ``cursors`` on, in position order,
    as ``(shard, j, Sample or DataError)`` (``j``: the document's index within its shard)."""

    def __init__(
        self,
        reading: dict,
        encoder: ConversationEncoder,
        shards: list[int],
        count: int,
        cursors: dict[int, int],
    ) -> None:
        self.reading, self.encoder = reading, encoder
        self.shards, self.count, self.cursors = shards, count, cursors

    def _positions(self) -> Iterator[tuple[int, int, int]]:
        """``(shard, j, global position)`` of this reader's documents, increasing (below the
        reading's ``limit`` when it has one)."""
        limit = self.reading.get("limit")
        for j in itertools.count(min(self.cursors.values())):
            for shard in self.shards:
                if limit is not None and shard + self.count * j >= limit:
                    return
                if j >= self.cursors[shard]:
                    yield shard, j, shard + self.count * j

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        mine = itertools.islice(self._positions(), worker, None, workers)
        if self.reading.get("source"):
            yield from self._from_source(mine)
        else:
            yield from self._from_file(mine)

    def _encode(self, shard: int, j: int, read: Callable[[], Any], name: str, base: Path):
        """``(shard, j, the document read by read() and encoded, or its DataError)``."""
        try:
            return shard, j, self.encoder(read(), name, base)
        except DataError as error:
            return shard, j, error

    def _from_file(self, mine: Iterator[tuple[int, int, int]]):
        reading = self.reading
        rows = open_rows(reading["path"], reading.get("split", "train"), reading.get("subset"))
        n = len(rows)
        epoch, order = -1, range(n)
        for shard, j, position in mine:
            e, i = divmod(position, n)
            if e != epoch and reading.get("shuffle", True):
                g = torch.Generator().manual_seed(reading.get("seed", 0) * 1_000_003 + e)
                order = torch.randperm(n, generator=g).tolist()
            epoch = e
            k = order[i]
            yield self._encode(shard, j, lambda k=k: rows.row(k), rows.name(k), rows.base_of(k))

    def _from_source(self, mine: Iterator[tuple[int, int, int]]):
        """The iterable's items in order (read again from the start when it ends); every
        worker reads them all and encodes its own."""
        reading, make = self.reading, _user_source(self.reading["source"])
        shard, j, want = next(mine)
        g = 0
        while True:
            empty = True
            for row in make():
                empty = False
                if g == want:
                    name = f"{reading['source']}:{g}"
                    yield self._encode(shard, j, lambda row=row: row, name, Path.cwd())
                    shard, j, want = next(mine)
                g += 1
            if empty:
                raise DataError(f"data.source {reading['source']} yielded no rows")
