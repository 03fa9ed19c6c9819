"""The data stage: documents from the synthetic stream or a conversation dataset (through the
model's processor), packed into rows, sharded over the data-parallel ranks, resumable.

- :mod:`~qwen35_trainer.data.batch`: :class:`Sample` (one document), :class:`Batch` (rows),
  :class:`DataError`;
- :mod:`~qwen35_trainer.data.synthetic`: the seeded synthetic stream;
- :mod:`~qwen35_trainer.data.conversation`: conversation rows through the processor (masking);
- :mod:`~qwen35_trainer.data.media`: images and videos read for the processor;
- :mod:`~qwen35_trainer.data.sources`: a rank's documents from a file or an iterable;
- :mod:`~qwen35_trainer.data.loader`: the sharded, resumable, worker-parallel packed stream;
- :mod:`~qwen35_trainer.data.packing`: documents into one packed row (data only);
- :mod:`~qwen35_trainer.data.feed`: each step's micro-batches (both streams), the loader's
  checkpointed state;
- :mod:`~qwen35_trainer.data.check`: what ``qwen35-train data check`` reports.
"""

from qwen35_trainer.data import batch, synthetic
from qwen35_trainer.data.batch import *  # noqa: F403 (its __all__: the records)
from qwen35_trainer.data.synthetic import *  # noqa: F403 (its __all__: the synthetic stream)

# the data stage's common names: every public name of its records and of the synthetic stream
__all__ = [*batch.__all__, *synthetic.__all__]
