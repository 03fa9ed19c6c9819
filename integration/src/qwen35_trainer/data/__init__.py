"""The data stage: documents from the synthetic stream or a conversation dataset (through the
model's processor), packed into rows, sharded over the data-parallel ranks, resumable.

- :mod:`~qwen35_trainer.data.batch`: :class:`Sample` (one document) and :class:`Batch` (rows);
- :mod:`~qwen35_trainer.data.synthetic`: the seeded synthetic stream;
- :mod:`~qwen35_trainer.data.packing`: documents into one packed row, the packed forward;
"""

from qwen35_trainer.data.batch import IGNORE_INDEX, MEDIA_FIELDS, Batch, Sample, collate
from qwen35_trainer.data.synthetic import (
    HELD_OUT_INDEX,
    global_batch,
    rank_batch,
    rank_samples,
    sample,
    text_vocab,
)

__all__ = [
    "HELD_OUT_INDEX",
    "IGNORE_INDEX",
    "MEDIA_FIELDS",
    "Batch",
    "Sample",
    "collate",
    "global_batch",
    "rank_batch",
    "rank_samples",
    "sample",
    "text_vocab",
]
