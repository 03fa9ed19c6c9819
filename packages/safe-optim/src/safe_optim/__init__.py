"""Optimizers that survive zero-numel local shards, with DCP round trips."""

__version__ = "0.1.0"

__all__ = ["__version__"]
