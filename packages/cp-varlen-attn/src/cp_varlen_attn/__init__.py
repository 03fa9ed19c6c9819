"""Sequence packing, block-diagonal varlen attention and the gated delta rule under context parallelism."""

__version__ = "0.1.0"

__all__ = ["__version__"]
