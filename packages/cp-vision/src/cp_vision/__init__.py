"""Frame-level context-parallel sharding of a Qwen-VL-style vision tower.

:func:`plan_frames` cuts the images and video frames of a batch into one contiguous,
cost-balanced range per rank; :func:`run_vision_sharded` encodes this rank's range and
all-gathers the merged tokens (backward: reduce-scatter with sum) so every rank holds what the
unsharded tower returns.
"""

from cp_vision.gather import VarlenAllGather, varlen_all_gather
from cp_vision.plan import DEFAULT_COST_ALPHA, FramePlan, plan_frames
from cp_vision.shard import run_vision_sharded

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_COST_ALPHA",
    "FramePlan",
    "VarlenAllGather",
    "__version__",
    "plan_frames",
    "run_vision_sharded",
    "varlen_all_gather",
]
