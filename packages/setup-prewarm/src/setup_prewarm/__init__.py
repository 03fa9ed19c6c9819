"""cuBLAS, communicator and fla prewarms with a report.

``prewarm(model, ...)`` moves the lazy, outside-the-allocator initialisations of a first
training step (cuBLAS handles and workspaces, NCCL communicators, fla's Triton autotuning) to
setup time, best-effort, without touching the RNG state, and returns a :class:`PrewarmReport`.
"""

from setup_prewarm.comm import GroupTarget, collect_groups
from setup_prewarm.gdn import GDNShape, find_gdn_shapes, is_gdn_layer
from setup_prewarm.report import PrewarmReport, StepReport
from setup_prewarm.runner import prewarm

__version__ = "0.1.0"

__all__ = [
    "GDNShape",
    "GroupTarget",
    "PrewarmReport",
    "StepReport",
    "__version__",
    "collect_groups",
    "find_gdn_shapes",
    "is_gdn_layer",
    "prewarm",
]
