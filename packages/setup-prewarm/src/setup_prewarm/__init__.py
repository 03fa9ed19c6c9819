"""cuBLAS, communicator and fla prewarms with a report."""

__version__ = "0.1.0"

__all__ = ["__version__"]
