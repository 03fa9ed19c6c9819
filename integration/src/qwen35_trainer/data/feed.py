"""The training loop's data: each step's micro-batches from the synthetic stream (a pure function
of the step) or from a conversation dataset (:class:`~qwen35_trainer.data.loader.DataStream`,
whose position — every shard's cursor, gathered by one all-reduce — is the feed's state dict,
saved with each checkpoint).

A step's samples (synthetic) or packed rows (dataset) are split into ``train.grad_accum_steps``
equal consecutive parts, one per micro-batch; a part's documents become one packed row
(``data.packing``) or right-padded rows. Both streams go through the same assembly, so the
held-out batches are built exactly as the training ones.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import torch
import torch.distributed as dist

from qwen35_trainer.data.batch import collate
from qwen35_trainer.data.loader import DataStream
from qwen35_trainer.data.packing import pack, pad_token_id
from qwen35_trainer.data.synthetic import HELD_OUT_INDEX, rank_samples

__all__ = ["Feed", "StepCounts", "micro_batches", "row_micro_batches"]


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """How the step's data came: the seconds the step waited for it, and with a dataset the
    rows' fill and the documents over capacity / rows skipped (global); ``sources``: where this
    rank's documents of the step came from (``file:row``, in order)."""

    seconds: float
    fill: float | None = None
    over_capacity: int = 0
    bad_rows: int = 0
    sources: tuple[str, ...] = ()


class Feed:
    """``step(s)`` → this rank's micro-batches of step ``s`` and the step's counts."""

    def __init__(self, recipe: Any, config: Any, layout, device: torch.device) -> None:
        self.recipe, self.config, self.layout, self.device = recipe, config, layout, device
        self.stream = None
        if recipe.data.dataset:
            if recipe.train.eval_every and not recipe.data.eval_path:
                raise ValueError(
                    "train.eval_every > 0 needs data.eval_path (held-out rows) "
                    "when the run reads a dataset"
                )
            self.stream = DataStream(recipe, config, layout, device)

    def step(self, step: int) -> tuple[list, StepCounts]:
        began = time.perf_counter()
        if self.stream is None:
            micro, sources = micro_batches(self.recipe, self.config, self.layout, step, self.device)
            return micro, StepCounts(time.perf_counter() - began, sources=sources)
        data = self.stream.next_step()
        waited = time.perf_counter() - began
        micro = row_micro_batches(data.rows, self.recipe, self.config, self.layout, self.device)
        sources = tuple(doc.source for row in data.rows for doc in row)
        counts = StepCounts(waited, data.fill, data.truncated + data.dropped, data.skipped, sources)
        return micro, counts

    def eval_batches(self):
        """``batches(e)`` for :func:`qwen35_trainer.train.step.evaluate`: held-out step ``e``'s
        micro-batches — the synthetic stream from :data:`HELD_OUT_INDEX` on, or the held-out
        rows (``data.eval_path``) from their start."""
        recipe, config, layout, device = self.recipe, self.config, self.layout, self.device
        if self.stream is None:
            return lambda e: micro_batches(
                recipe, config, layout, e, device, offset=HELD_OUT_INDEX
            )[0]
        held_out = DataStream(recipe, config, layout, device, eval=True)
        return lambda _: row_micro_batches(
            held_out.next_step().rows, recipe, config, layout, device
        )

    def state_dict(self) -> dict | None:
        """Where the dataset stream stands — every shard's cursor, gathered over the ranks
        (every rank calls it: one all-reduce) — or ``None`` for the synthetic stream (a pure
        function of the step)."""
        if self.stream is None:
            return None
        state = self.stream.state_dict()
        cursors = torch.zeros(state["shards"], dtype=torch.long, device=self.device)
        for shard, j in state["cursors"].items():
            cursors[shard] = j
        if dist.is_initialized():
            dist.all_reduce(cursors, op=dist.ReduceOp.MAX)  # each shard is one rank's (or peers')
        return {"shards": state["shards"], "cursors": cursors.tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Continue the dataset where :meth:`state_dict` was taken."""
        self.stream.load_state_dict(state)


def micro_batches(
    recipe: Any, config: Any, layout, step: int, device: torch.device, *, offset: int = 0
):
    """This rank's ``(batch, packed inputs or None)`` per micro-batch of synthetic step ``step``
    (``offset``: the stream's first sample index, :data:`HELD_OUT_INDEX` for held-out batches),
    and its documents' sources."""
    samples = rank_samples(
        recipe.model, recipe.data, step, layout.data_group, layout.data_groups, offset=offset
    )
    parts = _split(samples, recipe.train.grad_accum_steps, "data.samples_per_rank", "samples")
    micro = _micro(parts, recipe, config, layout, device, recipe.data.pack_length)
    return micro, tuple(s.source for s in samples)


def row_micro_batches(rows: list, recipe: Any, config: Any, layout, device: torch.device):
    """This rank's ``(batch, packed inputs)`` per micro-batch of a dataset step: its packed
    ``rows`` (:meth:`qwen35_trainer.data.loader.DataStream.next_step`) split evenly over
    ``train.grad_accum_steps`` micro-batches, a micro-batch's rows packed as one sequence."""
    parts = _split(
        rows,
        recipe.train.grad_accum_steps,
        "packed rows per rank (data.global_batch / data-parallel ranks)",
        "rows",
    )
    docs = [[doc for row in part for doc in row] for part in parts]
    return _micro(docs, recipe, config, layout, device, len(parts[0]) * recipe.data.pack_length)


def _split(items: list, n: int, what: str, unit: str) -> list[list]:
    """``items`` in ``n`` equal consecutive parts (one per micro-batch)."""
    if len(items) % n:
        raise ValueError(
            f"{what}={len(items)} must be a multiple of train.grad_accum_steps={n} "
            f"(each micro-batch takes the same number of {unit})"
        )
    size = len(items) // n
    return [items[first : first + size] for first in range(0, len(items), size)]


def _micro(
    parts: list[list], recipe: Any, config: Any, layout, device: torch.device, capacity: int | None
) -> list:
    """Each part's documents as one packed row (``capacity`` tokens at most), or right-padded
    rows without ``data.packing``, on ``device``."""
    pad = pad_token_id(config)
    out = []
    for docs in parts:
        if recipe.data.packing:
            packing = functools.partial(
                pack, docs, config, pad, cp=layout.cp, group=layout.cp_group, capacity=capacity
            )
            batch, packed = packing(multiple=layout.row_multiple)
            if layout.pipelined and not _fits_buffers(packed.layout, capacity):
                batch, packed = packing(multiple=capacity)
            out.append((batch.to(device), packed.to(device)))
        else:
            out.append((collate(docs, pad).to(device), None))
    return out


def _fits_buffers(cp_layout: Any, capacity: int) -> bool:
    """Whether every CP rank's tokens of a packed row fit its share of the pipeline stages'
    buffers (``capacity / cp``): the row then travels as it is, each stage padding its rank's
    tokens to the buffer only to send them (:mod:`qwen35_trainer.model.pipeline.stages`), and
    no layer computes the padding; else (a full row the layout splits unevenly) the row is
    padded to its capacity, as one padding document every layer runs."""
    share = capacity // cp_layout.cp_size
    return all(cp_layout.local_len(r) <= share for r in range(cp_layout.cp_size))
