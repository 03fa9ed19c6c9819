"""The GPUs the step-time model (:mod:`.timing`) prices a plan on: datasheet numbers per GPU.

Each profile is the vendor's published figures for one SXM GPU in an 8-GPU HGX / DGX node:

- ``bf16_tflops``: dense BF16 tensor-core peak (the datasheets print the 2:4-sparse figure,
  twice this): H100 SXM and H200 989 TFLOP/s, B200 2,250 (the figures ``mfu`` already uses,
  :data:`qwen35_trainer.model.flops.PEAK_BF16_FLOPS`);
- ``hbm_tbps``: HBM bandwidth: H100 SXM 3.35 TB/s (HBM3), H200 4.8 TB/s (HBM3e), B200 8 TB/s;
- ``nvlink_gbps``: NVLink bandwidth ONE WAY per GPU, half the bidirectional figure the
  datasheets print (a rank's send rate is what a collective's bytes sent divide by): 4th
  generation 900 GB/s → 450 (H100, H200), 5th generation 1.8 TB/s → 900 (B200);
- ``ib_gbps``: InfiniBand one way per GPU: the DGX H100 / H200 / B200 nodes give each GPU one
  ConnectX-7 port of 400 Gb/s = 50 GB/s;
- ``memory_gib``: what the GPU's memory holds, the verdict's default (``--gpu-memory``
  overrides it): 80 for the H100 (the planner's own default since it was written), 140 for the
  H200 (141 GB: 143,771 MiB), 179 for the B200 (180 GB: 183,359 MiB).

``qwen35-train plan --gpu h200`` picks one; ``--gpu-set NAME=VALUE`` (repeatable) changes a
field, e.g. ``--gpu-set ib_gbps=25`` for one 200 Gb/s port per GPU.
"""

from __future__ import annotations

import dataclasses

from qwen35_trainer.model.flops import PEAK_BF16_FLOPS
from qwen35_trainer.plan.flags import named_values

__all__ = ["GPUS", "Hardware", "hardware"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    key: str  # its name in :data:`GPUS` (``--gpu``)
    name: str
    bf16_tflops: float
    hbm_tbps: float
    nvlink_gbps: float  # one way, per GPU
    ib_gbps: float  # one way, per GPU
    memory_gib: float

    @property
    def peak_flops(self) -> float:
        """Dense BF16 FLOP/s."""
        return self.bf16_tflops * 1e12


GPUS = {
    "h100": Hardware("h100", "H100 SXM", PEAK_BF16_FLOPS["H100"] / 1e12, 3.35, 450.0, 50.0, 80.0),
    "h200": Hardware("h200", "H200 SXM", PEAK_BF16_FLOPS["H200"] / 1e12, 4.8, 450.0, 50.0, 140.0),
    "b200": Hardware("b200", "B200", PEAK_BF16_FLOPS["B200"] / 1e12, 8.0, 900.0, 50.0, 179.0),
}


def hardware(name: str = "h100", sets: list[str] | tuple[str, ...] = ()) -> Hardware:
    """The profile ``name`` (:data:`GPUS`) with each ``NAME=VALUE`` of ``sets`` applied;
    ``ValueError`` naming an unknown GPU or a bad item."""
    if name not in GPUS:
        raise ValueError(f"--gpu {name!r}: expected one of {sorted(GPUS)}")
    fields = [f.name for f in dataclasses.fields(Hardware) if f.name not in ("key", "name")]
    values = named_values(sets, fields, "--gpu-set", lambda v: v > 0, "VALUE > 0")
    return dataclasses.replace(GPUS[name], **values)
