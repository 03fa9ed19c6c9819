"""The training loop's data: each step's micro-batches from the synthetic stream (a pure function
of the step) or from a conversation dataset (:class:`~qwen35_trainer.data.loader.DataStream`,
whose position travels with the checkpoints as ``data_state.json``: every shard's cursor,
gathered by one all-reduce).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DATA_STATE", "Feed", "StepCounts"]

DATA_STATE = "data_state.json"


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

    def __init__(self, recipe: Any, model, layout, device: torch.device) -> None:
        self.recipe, self.model, self.layout, self.device = recipe, model, layout, device
        self.stream = None
        if recipe.data.dataset:
            from qwen35_trainer.data.loader import DataStream

            if recipe.train.eval_every and not recipe.data.eval_path:
                raise ValueError("train.eval_every > 0 needs data.eval_path (held-out rows) "
                                 "when the run reads a dataset")  # fmt: skip
            self.stream = DataStream(recipe, model.config, layout, device)

    def step(self, step: int) -> tuple[list, StepCounts]:
        from qwen35_trainer.step import micro_batches, row_micro_batches

        began = time.perf_counter()
        if self.stream is None:
            micro, sources = micro_batches(self.recipe, self.model, self.layout, step, self.device)
            return micro, StepCounts(time.perf_counter() - began, sources=sources)
        data = self.stream.next_step()
        waited = time.perf_counter() - began
        micro = row_micro_batches(data.rows, self.recipe, self.model, self.layout, self.device)
        sources = tuple(doc.source for row in data.rows for doc in row)
        counts = StepCounts(waited, data.fill, data.truncated + data.dropped, data.skipped, sources)
        return micro, counts

    def eval_batches(self):
        """``batches(e)`` for :func:`qwen35_trainer.step.evaluate`: ``None`` (the synthetic
        held-out stream) or the held-out rows from their start."""
        if self.stream is None:
            return None
        from qwen35_trainer.data.loader import DataStream
        from qwen35_trainer.step import row_micro_batches

        held_out = DataStream(self.recipe, self.model.config, self.layout, self.device, eval=True)

        def batches(_: int):
            rows = held_out.next_step().rows
            return row_micro_batches(rows, self.recipe, self.model, self.layout, self.device)

        return batches

    def state_file(self) -> dict[str, str]:
        """``{data_state.json: ...}`` for the checkpoint (every rank calls it: one all-reduce),
        or ``{}`` for the synthetic stream."""
        if self.stream is None:
            return {}
        state = self.stream.state_dict()
        cursors = torch.zeros(state["shards"], dtype=torch.long, device=self.device)
        for shard, j in state["cursors"].items():
            cursors[shard] = j
        if dist.is_initialized():
            dist.all_reduce(cursors, op=dist.ReduceOp.MAX)  # each shard is one rank's (or peers')
        return {DATA_STATE: json.dumps({"shards": state["shards"], "cursors": cursors.tolist()})}

    def restore(self, checkpoint: Path) -> None:
        """Continue the dataset where the checkpoint's run stopped."""
        if self.stream is None:
            return
        file = checkpoint / DATA_STATE
        if not file.is_file():
            raise ValueError(f"{checkpoint} has no {DATA_STATE}: it was saved by a run without a "
                             "dataset, so where to continue in this one is unknown")  # fmt: skip
        try:
            self.stream.load_state_dict(json.loads(file.read_text()))
        except ValueError as error:
            raise ValueError(f"{file}: {error}") from error
