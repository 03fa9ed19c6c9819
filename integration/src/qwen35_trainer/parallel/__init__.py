"""The parallel stage: :class:`ParallelDims` (degrees and meshes) and :func:`parallelize`
(TP, EP, AC, FSDP in that order), giving this rank's :class:`Layout`."""

from qwen35_trainer.parallel.apply import FSDP_UNITS, apply_parallelism
from qwen35_trainer.parallel.dims import EP_FIRST, Meshes, ParallelDims
from qwen35_trainer.parallel.layout import Layout, check_layout, parallelize
from qwen35_trainer.parallel.tp_plan import TP_PLAN

__all__ = [
    "EP_FIRST",
    "FSDP_UNITS",
    "TP_PLAN",
    "Layout",
    "Meshes",
    "ParallelDims",
    "apply_parallelism",
    "check_layout",
    "parallelize",
]
