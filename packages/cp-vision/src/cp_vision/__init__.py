"""Frame-level context-parallel sharding of a Qwen-VL-style vision tower."""

__version__ = "0.1.0"

__all__ = ["__version__"]
