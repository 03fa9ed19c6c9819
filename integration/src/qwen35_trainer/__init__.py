"""Long-context trainer for Qwen3.5 MoE-VLM models (not written yet: only the version for now)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
