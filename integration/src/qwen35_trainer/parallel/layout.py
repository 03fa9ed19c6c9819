"""This rank's place in a run (:class:`Layout`), derived from :class:`ParallelDims`' meshes.

The layout says which tokens this rank holds and which groups its collectives use; it is read
from mesh coordinates, never computed from the global rank, so no rank order is assumed:

- ``data_index`` of ``data_size``: which data-parallel group's rows of the step it takes
  (its ``dp_replicate``, ``dp_shard`` coordinates);
- under CP the ranks of ``cp_group`` share one packed row, each holding the pieces its layout
  assigns (its position in the group is its piece index);
- ``loss_group``: every rank holding different tokens (``dp_replicate × dp_shard × cp``; TP
  peers hold the same tokens and are left out so nothing is counted twice): the valid-label
  count, the aux-loss statistics and the logged totals are summed over it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from qwen35_trainer.parallel.apply import apply_parallelism
from qwen35_trainer.parallel.dims import Meshes, ParallelDims

__all__ = ["Layout", "check_layout", "parallelize"]


@dataclasses.dataclass
class Layout:
    """Where this rank sits (one process: the defaults)."""

    data_index: int = 0
    data_size: int = 1
    loss_group: Any = None
    cp: int = 1
    cp_group: Any = None
    meshes: Meshes | None = None

    @classmethod
    def from_meshes(cls, meshes: Meshes) -> Layout:
        dims = meshes.dims
        return cls(
            data_index=meshes.data_index(),
            data_size=dims.data_parallel,
            loss_group=meshes.batch.get_group() if dims.batch > 1 else None,
            cp=dims.cp,
            cp_group=meshes.cp.get_group() if dims.cp > 1 else None,
            meshes=meshes,
        )


def check_layout(spec: Any, world: int, *, packing: bool) -> ParallelDims:
    """The run's :class:`ParallelDims` from the recipe's ``parallel`` section, or ``ValueError``
    with every reason it cannot run in ``world`` ranks."""
    reasons = []
    try:
        dims = ParallelDims.from_recipe(spec, world)
    except ValueError as err:
        reasons.append(str(err).removeprefix("invalid parallel layout: "))
        dims = None
    if spec.cp > 1 and not packing:
        reasons.append(
            "parallel.cp > 1 needs data.packing: context parallelism splits ONE packed row "
            "over the CP ranks by its document layout"
        )
    if spec.tp > 1 and not packing:
        reasons.append(
            "parallel.tp > 1 needs data.packing: the TP-split Gated DeltaNet layers run "
            "cp-varlen-attn's packed forward on this rank's heads"
        )
    if reasons:
        raise ValueError("invalid parallel layout: " + "; ".join(reasons))
    return dims


def parallelize(
    objective: torch.nn.Module,
    spec: Any,
    device: torch.device,
    *,
    packing: bool = False,
    activation_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
    force_fsdp: bool = False,
) -> Layout:
    """Build the meshes of the recipe's layout, apply TP, EP, AC and FSDP2 in place; returns
    this rank's :class:`Layout`. One process: only activation checkpointing (and no meshes),
    unless ``force_fsdp`` (a one-rank process group exists: the trainer's one process runs the
    same FSDP2 program as every layout)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = check_layout(spec, world, packing=packing)
    if world == 1 and not force_fsdp:
        if activation_checkpointing:
            from moe_parallel import apply_activation_checkpointing

            apply_activation_checkpointing(objective.model)
        return Layout()
    meshes = dims.build(device.type)
    apply_parallelism(
        objective, meshes, activation_checkpointing=activation_checkpointing,
        param_dtype=param_dtype,
    )  # fmt: skip
    return Layout.from_meshes(meshes)
