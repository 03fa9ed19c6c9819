"""Apply the recipe's parallelism to the model, in the repository's fixed order: EP, AC, FSDP.

Layout: ``dp`` ranks, each with its own rows of the global batch. With ``ep > 1`` the ranks
form a ``(dp // ep, "dp") x (ep, "ep")`` mesh: every MoE's routed experts are split over
``"ep"`` (:func:`moe_parallel.apply_expert_parallel`; tokens travel to their experts' ranks and
back), dense parameters are FSDP-sharded over all ranks (``dp`` x ``ep`` flattened), experts
over ``"dp"`` only (:func:`fsdp_compat.shard_model` with ``ep_dim="ep"``).

Why the gradients are the one-process gradients: every rank backpropagates ``dp * share`` of
the global loss (see :mod:`qwen35_trainer.train`). FSDP2 divides a dense gradient by the size of
its reduce-scatter group, ``dp``: the sum of the shares' gradients. An expert's gradient on its
owner already SUMS the contributions of the ``ep`` ranks whose tokens it served (the dispatch's
backward returns them), and FSDP then averages it over the ``dp // ep`` expert replicas only: it
comes out ``ep`` times too large. :meth:`Layout.after_backward` divides the expert gradients by
``ep`` before clipping. (FSDP2's ``set_gradient_divide_factor`` would do it inside the
reduce-scatter, but needs ``PREMUL_SUM``, which gloo lacks; one division is backend-neutral.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compat import shard_model
from moe_parallel import apply_activation_checkpointing, apply_expert_parallel
from qwen35_trainer.model import moe_blocks
from qwen35_trainer.objective import TrainingObjective
from qwen35_trainer.recipe import ParallelRecipe

__all__ = ["Layout", "parallelize"]


@dataclasses.dataclass
class Layout:
    """Where this rank sits: its data-parallel rank, and the group over which the global batch is
    split (``None`` in one process)."""

    data_rank: int
    data_group: Any
    mesh: Any
    ep: int = 1

    def after_backward(self, objective: TrainingObjective) -> None:
        """Divide the routed experts' gradients by ``ep`` (see the module docstring)."""
        if self.ep == 1:
            return
        for block in moe_blocks(objective.model):
            for param in block.experts.parameters():
                if param.grad is not None:
                    param.grad.div_(self.ep)


def check_layout(spec: ParallelRecipe, world: int) -> None:
    if spec.dp != world:
        raise ValueError(
            f"parallel.dp={spec.dp} must equal the launched world size {world} (WORLD_SIZE); "
            f"launch with `torchrun --nproc-per-node {spec.dp} ...` or set parallel.dp={world}"
        )
    if spec.ep < 1 or spec.dp % spec.ep:
        raise ValueError(f"parallel.ep={spec.ep} must divide parallel.dp={spec.dp}")


def parallelize(
    objective: TrainingObjective,
    spec: ParallelRecipe,
    device: torch.device,
    *,
    activation_checkpointing: bool = False,
) -> Layout:
    """EP, activation checkpointing, then FSDP2, in place; returns this rank's :class:`Layout`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_layout(spec, world)
    mesh = None
    if spec.ep > 1:
        mesh = init_device_mesh(
            device.type, (spec.dp // spec.ep, spec.ep), mesh_dim_names=("dp", "ep")
        )
        apply_expert_parallel(objective.model, mesh["ep"])
    elif spec.dp > 1:
        mesh = init_device_mesh(device.type, (spec.dp,), mesh_dim_names=("dp",))
    if activation_checkpointing:
        apply_activation_checkpointing(objective.model)
    if spec.dp > 1:
        shard_dims = ("dp", "ep") if spec.ep > 1 else ("dp",)
        shard_model(objective, mesh, shard_dims=shard_dims)
    if world == 1:
        return Layout(data_rank=0, data_group=None, mesh=mesh)
    return Layout(dist.get_rank(), dist.group.WORLD, mesh, ep=spec.ep)
