"""The data stage: documents from the synthetic stream or a conversation dataset (through the
model's processor), packed into rows, sharded over the data-parallel ranks, resumable.

- :mod:`~qwen35_trainer.data.batch`: :class:`Sample` (one document), :class:`Batch` (rows),
  :class:`DataError`;
- :mod:`~qwen35_trainer.data.synthetic`: the seeded synthetic stream;
- :mod:`~qwen35_trainer.data.conversation`: conversation rows through the processor (masking);
- :mod:`~qwen35_trainer.data.media`: images and videos read for the processor;
- :mod:`~qwen35_trainer.data.loader`: the sharded, resumable, worker-parallel packed stream;
- :mod:`~qwen35_trainer.data.packing`: documents into one packed row (data only);
- :mod:`~qwen35_trainer.data.feed`: each step's micro-batches (both streams), the loader's
  checkpointed state;
- :mod:`~qwen35_trainer.data.demo`: the built-in demo dataset and its processor directory;
- :mod:`~qwen35_trainer.data.check`: what ``qwen35-train data check`` reports.
"""

from qwen35_trainer.data.batch import (
    IGNORE_INDEX,
    MEDIA_FIELDS,
    Batch,
    DataError,
    Sample,
    collate,
)
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
    "DataError",
    "Sample",
    "collate",
    "global_batch",
    "rank_batch",
    "rank_samples",
    "sample",
    "text_vocab",
]
