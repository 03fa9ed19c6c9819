"""Tensor-parallel linear layers shaped for Inductor's micro-pipeline TP (async TP) fusion."""

__version__ = "0.1.0"

__all__ = ["__version__"]
