"""Optimizers that survive zero-numel local shards, with DCP round trips.

``build_optimizer(params_or_groups, optimizer="adamw", **kwargs)`` builds a torch optimizer by
name or factory. For backends that fail on tensors with zero elements (TransformerEngine's fused
Adam, or any declared with ``declare_no_empty_tensors``), parameters whose local shard is empty on
this rank are left out of the step — exact, because the ranks that own their elements update
them — while every rank keeps identical param groups, so LR schedulers and
``torch.distributed.checkpoint`` optimizer state dicts work across ranks (and world sizes) whose
kept sets differ.
"""

from safe_optim.backends import OPTIMIZER_NAMES, accepts_empty_tensors, declare_no_empty_tensors
from safe_optim.build import build_optimizer
from safe_optim.filtered import local_numel

__version__ = "0.1.0"

__all__ = [
    "OPTIMIZER_NAMES",
    "__version__",
    "accepts_empty_tensors",
    "build_optimizer",
    "declare_no_empty_tensors",
    "local_numel",
]
