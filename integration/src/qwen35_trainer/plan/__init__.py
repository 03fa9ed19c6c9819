"""The dry-run planner: will a recipe fit, before anyone books the GPUs?

- :mod:`.planner`: :func:`plan` — the model built on the meta device and parallelised by the
  trainer's own code for the first and last rank of a fake world, every byte accounted;
- :mod:`.memory`: the per-rank tensors (parameters, gradients, optimizer state, activations),
  the activations' bytes per token by :mod:`.activations`;
- :mod:`.headroom`: what the GPU holds beyond them (CUDA context, cuBLAS, NCCL, fragmentation);
- :mod:`.traffic`: the bytes each rank sends per step, by kind of collective;
- :mod:`.work`: each planned rank's FLOPs per kind and passes (forward, recompute, backward);
- :mod:`.hardware`: the GPU profiles (H100 SXM, H200, B200) the step is timed on;
- :mod:`.timing`: :func:`.timing.step_time` — step time, tokens/s/GPU, TFLOP/s/GPU, MFU and the
  exposed communication per group;
- :mod:`.measure` (``plan --measure``): this machine measured at the plan's shapes — op classes,
  calls (:mod:`.step_probe`), the local link (:mod:`.links`, :mod:`.local_ranks`), each parallel
  dimension's own cost (:mod:`.layout_cost`), one step's memory (:mod:`.memory_probe`) —
  into a :class:`.profile.Profile`, which :mod:`.measured_time` prices the plan with
  (``--profile``);
- :mod:`.published`: the model against the published Qwen3.6-35B-A3B runs;
- :mod:`.world`: the fake process group;
- :mod:`.report`: the table ``qwen35-train plan`` prints.
"""

from qwen35_trainer.plan.headroom import Headroom
from qwen35_trainer.plan.planner import GIB, Plan, plan, row_shape
from qwen35_trainer.plan.report import format_plan
from qwen35_trainer.plan.traffic import communication

__all__ = ["GIB", "Headroom", "Plan", "communication", "format_plan", "plan", "row_shape"]
