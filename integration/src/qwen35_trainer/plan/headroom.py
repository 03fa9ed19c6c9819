"""What a GPU holds beyond the tensors the planner counts, as stated terms.

The planner counts tensors (:mod:`.memory`): parameters, gradients and moments exactly, the
activations and buffers by formulas. A real process also holds memory that no tensor accounts
for, and a verdict that leaves it out promises what the GPU will refuse (the 122B recipe counts
33.8 GiB per GPU where the published run peaked at 60.55 GiB). Each term below is a stated
default, printed on its own line and changed with ``qwen35-train plan --headroom NAME=VALUE``:

- ``cuda_context_gib``: the CUDA context with the kernels of torch, NCCL, cuBLAS and the fused
  kernels loaded (0.5–1 GiB on H100 with CUDA 12);
- ``cublas_gib``: cuBLAS / cuBLASLt workspaces (32 MiB per handle and stream on Hopper; the
  training, NCCL and DCP streams, fp32 and bf16 handles);
- ``nccl_gib_per_group``: NCCL's buffers per communicator this rank joins (channels × peers ×
  ``NCCL_BUFFSIZE``, plus NVLink SHARP buffers on H100), times the number of process groups
  of the layout (:func:`process_groups`);
- ``fragmentation``: the caching allocator's reserve above the allocated peak — freed blocks
  of other sizes it keeps (variable-length all-to-all and vision rows make MoE-VLM training
  fragment), and the backward's transient copies the formulas do not model — as a fraction
  of what is allocated and freed within a step: the counted peak less the parameters and the
  optimizer state, which are allocated once and never freed, so they fragment nothing (a
  frozen 70 GiB base adds no reserve). 1.0 — the allocator holding as much again as a step's
  transient tensors — is calibrated on the one published measurement at hand: the 122B
  recipe (the published run's layout) then predicts 60.1 GiB against the 60.55 GiB reported.
  Calibrate it from a first real step: ``torch.cuda.memory_reserved()`` less the persistent
  tensors, over ``max_memory_allocated()`` less them.
"""

from __future__ import annotations

import dataclasses

from qwen35_trainer.parallel import ParallelDims
from qwen35_trainer.plan.flags import named_values

__all__ = ["Headroom", "process_groups"]

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Headroom:
    cuda_context_gib: float = 0.75
    cublas_gib: float = 0.25
    nccl_gib_per_group: float = 0.5
    fragmentation: float = 1.0

    @classmethod
    def parse(cls, items: list[str]) -> Headroom:
        """``NAME=VALUE`` items over the defaults; ``ValueError`` naming a bad one."""
        names = [f.name for f in dataclasses.fields(cls)]
        values = named_values(items, names, "--headroom", lambda v: v >= 0, "VALUE >= 0")
        return cls(**values)

    def terms(self, transient: int, groups: int) -> dict[str, int]:
        """The bytes of each term for a rank whose counted tensors allocated and freed within
        a step peak at ``transient`` bytes and which joins ``groups`` process groups."""
        return {
            "cuda context": int(self.cuda_context_gib * GIB),
            "cuBLAS workspaces": int(self.cublas_gib * GIB),
            f"NCCL buffers ({groups} groups)": int(self.nccl_gib_per_group * GIB * groups),
            "allocator reserve": int(self.fragmentation * transient),
        }


def process_groups(dims: ParallelDims) -> int:
    """The communicators a rank of the layout ``dims`` joins: one per group of more than one
    rank that its meshes create (:attr:`ParallelDims.group_sizes`)."""
    return sum(1 for size in dims.group_sizes.values() if size > 1)
