"""Which of a layout's process groups span nodes: read off the trainer's own rank grids, so the
planner prices a group's bytes over InfiniBand exactly when the run's group would cross a node
(:mod:`.timing`) and the search counts the bytes sent over nodes (:mod:`.search`)."""

from __future__ import annotations

import math

import torch

from qwen35_trainer.parallel import ParallelDims

__all__ = ["crossing_groups"]


def crossing_groups(dims: ParallelDims, node_gpus: int) -> set[str]:
    """The communication kinds (:func:`qwen35_trainer.plan.traffic.communication`, and
    ``pp_p2p``) whose process groups span more than one node of ``node_gpus`` consecutive
    ranks, from the trainer's own rank grids (:meth:`ParallelDims.expert_grid`; the dense mesh
    is ``(pp, dp_replicate, dp_shard, cp, tp)`` in rank order)."""
    dense = torch.arange(dims.world).reshape(dims.dense_shape)
    expert = torch.stack([dims.expert_grid(stage) for stage in dense])  # [pp, r, efsdp, ep, t]

    def spans(grid: torch.Tensor, dim: int | tuple[int, ...]) -> bool:
        dims_ = (dim,) if isinstance(dim, int) else dim
        rest = [i for i in range(grid.dim()) if i not in dims_]
        groups = grid.permute(*rest, *dims_).reshape(-1, math.prod(grid.shape[i] for i in dims_))
        nodes = groups // node_gpus
        return bool((nodes.amax(1) != nodes.amin(1)).any())

    kinds = {
        "hsdp_all_reduce": spans(dense, 1),
        "fsdp_all_gather": spans(dense, (2, 3)),
        "fsdp_reduce_scatter": spans(dense, (2, 3)),
        "expert_fsdp_all_gather": spans(expert, 2),
        "expert_fsdp_reduce_scatter": spans(expert, 2),
        "ep_all_to_all": spans(expert, 3),
        "cp_exchange": spans(dense, 3),
        "vision_gather": spans(dense, 3),
        "pp_p2p": spans(dense, 0),
        "tp": spans(dense, 4),
    }
    return {kind for kind, crosses in kinds.items() if crosses}
