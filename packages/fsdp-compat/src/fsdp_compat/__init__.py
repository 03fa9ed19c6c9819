"""One sharding API over FSDP2 and megatron-fsdp 0.5/0.6."""

__version__ = "0.1.0"

__all__ = ["__version__"]
