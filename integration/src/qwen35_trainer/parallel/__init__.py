"""The parallel stage: :class:`ParallelDims` (degrees and meshes), :func:`parallelize` (TP, EP,
AC, FSDP in that order) giving this rank's :class:`Layout`, and the run's process group and
agreements (:mod:`.dist`)."""

from qwen35_trainer.parallel.apply import (
    FSDP_UNITS,
    Layout,
    apply_parallelism,
    parallelize,
    validate_layout,
)
from qwen35_trainer.parallel.dims import EP_FIRST, MeshAxis, Meshes, ParallelDims
from qwen35_trainer.parallel.tp_plan import TP_PLAN, tp_plan

__all__ = [
    "EP_FIRST",
    "FSDP_UNITS",
    "TP_PLAN",
    "Layout",
    "MeshAxis",
    "Meshes",
    "ParallelDims",
    "apply_parallelism",
    "parallelize",
    "tp_plan",
    "validate_layout",
]
