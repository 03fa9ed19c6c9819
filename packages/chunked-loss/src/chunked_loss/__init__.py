"""Memory-bounded (fused linear) cross-entropy: chunked forward and backward, vocab-parallel under TP, global-token normalisation."""

__version__ = "0.1.0"

__all__ = ["__version__"]
