"""Memory-bounded (fused linear) cross-entropy: chunked forward and backward, vocab-parallel under TP, global-token normalisation.

- :func:`linear_cross_entropy` — ``cross_entropy(hidden @ weight.T + bias, labels)`` without
  [N, V] logits; vocab-parallel when ``weight`` is a ``Shard(0)`` DTensor.
- :func:`chunked_cross_entropy` — cross-entropy of existing logits without an fp32 copy.
- :class:`LinearCrossEntropy` — lm_head + loss as one module (FSDP2-shardable).
- :func:`global_num_valid_tokens` — the global valid-token count for ``num_valid_tokens``.
- :func:`linear_chunk_bytes` — the bytes :func:`linear_cross_entropy`'s default chunk holds.
"""

from chunked_loss._checks import linear_chunk_bytes
from chunked_loss.linear import linear_cross_entropy
from chunked_loss.logits import chunked_cross_entropy
from chunked_loss.module import LinearCrossEntropy
from chunked_loss.tokens import global_num_valid_tokens

__version__ = "0.2.0"

__all__ = [
    "LinearCrossEntropy",
    "__version__",
    "chunked_cross_entropy",
    "global_num_valid_tokens",
    "linear_chunk_bytes",
    "linear_cross_entropy",
]
