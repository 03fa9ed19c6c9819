"""MoE layer with dropless expert parallelism, TP-safe plans, EP+TP gradient correctness and activation checkpointing."""

__version__ = "0.1.0"

__all__ = ["__version__"]
