"""Apply the recipe's parallelism to the model, in the repository's fixed order: EP, AC, FSDP.

Layouts (``world = dp * cp`` ranks):

- ``dp`` ranks, each with its own rows of the global batch, FSDP2 over all of them;
- ``ep > 1``: the ranks form a ``(dp // ep, "dp") x (ep, "ep")`` mesh; every MoE's routed
  experts are split over ``"ep"`` (:func:`moe_parallel.apply_expert_parallel`; tokens travel to
  their experts' ranks and back), dense parameters are FSDP-sharded over all ranks, experts over
  ``"dp"`` only (:func:`fsdp_compat.shard_model` with ``ep_dim="ep"``);
- ``cp > 1`` (needs packing): a ``(dp, "dp") x (cp, "cp")`` mesh; the ``cp`` ranks of a group
  share one packed row, each holding the pieces its layout assigns
  (:mod:`qwen35_trainer.packing`); FSDP2 over all ranks. With ``ep == cp`` the experts are split
  over the CP ranks (they hold different tokens, as EP needs) and FSDP-sharded over ``"dp"``.

Why the gradients are the one-process gradients: every rank holds different tokens and
backpropagates ``world * share`` of the global loss (see :mod:`qwen35_trainer.train`). FSDP2
divides a dense gradient by the size of its reduce-scatter group, ``world``: the sum of the
shares' gradients. An expert's gradient on its owner already SUMS the contributions of the
``ep`` ranks whose tokens it served (the dispatch's backward returns them), and FSDP then
averages it over the ``dp // ep`` expert replicas only: it comes out ``ep`` times too large.
:meth:`Layout.after_backward` divides the expert gradients by ``ep`` before clipping. (FSDP2's
``set_gradient_divide_factor`` would do it inside the reduce-scatter, but needs ``PREMUL_SUM``,
which gloo lacks; one division is backend-neutral.)
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
    """Where this rank sits. ``data_rank``: which rows of the step it takes (its DP index);
    ``data_group``: all ranks (each holds other tokens of the global batch; ``None`` in one
    process); ``world``: how many shares the global loss has; ``cp_group``: the ranks sharing this
    rank's packed row (``None`` without CP)."""

    data_rank: int = 0
    data_group: Any = None
    mesh: Any = None
    world: int = 1
    ep: int = 1
    cp: int = 1
    cp_group: Any = None

    def after_backward(self, objective: TrainingObjective) -> None:
        """Divide the routed experts' gradients by ``ep`` (see the module docstring)."""
        if self.ep == 1:
            return
        for block in moe_blocks(objective.model):
            for param in block.experts.parameters():
                if param.grad is not None:
                    param.grad.div_(self.ep)


def check_layout(spec: ParallelRecipe, world: int, *, packing: bool) -> None:
    """Raise ``ValueError`` (with the reason) for a layout that cannot run in ``world`` ranks."""
    if spec.dp < 1 or spec.cp < 1 or spec.dp * spec.cp != world:
        raise ValueError(
            f"parallel.dp={spec.dp} x parallel.cp={spec.cp} must equal the launched world size "
            f"{world} (WORLD_SIZE); launch with `torchrun --nproc-per-node {spec.dp * spec.cp} "
            "...` or change parallel.dp / parallel.cp"
        )
    if spec.cp == 1 and (spec.ep < 1 or spec.dp % spec.ep):
        raise ValueError(f"parallel.ep={spec.ep} must divide parallel.dp={spec.dp}")
    if spec.cp > 1 and not packing:
        raise ValueError(
            "parallel.cp > 1 needs data.packing: context parallelism splits ONE packed row "
            "over the CP ranks by its document layout"
        )
    if spec.cp > 1 and spec.ep not in (1, spec.cp):
        raise ValueError(
            f"with parallel.cp={spec.cp}, experts are split over the CP ranks: parallel.ep must "
            f"be 1 or {spec.cp}, got {spec.ep} (other EP groups under CP need a (dp, cp, ep) "
            "mesh, not wired yet)"
        )


def parallelize(
    objective: TrainingObjective,
    spec: ParallelRecipe,
    device: torch.device,
    *,
    packing: bool = False,
    activation_checkpointing: bool = False,
) -> Layout:
    """EP, activation checkpointing, then FSDP2, in place; returns this rank's :class:`Layout`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_layout(spec, world, packing=packing)
    mesh, shard_dims, ep_dim = None, ("dp",), "ep"
    if spec.cp > 1:
        mesh = init_device_mesh(device.type, (spec.dp, spec.cp), mesh_dim_names=("dp", "cp"))
        shard_dims = ("dp", "cp")
        if spec.ep > 1:  # EP over the CP ranks: they hold different tokens like DP ranks do
            ep_dim = "cp"
            apply_expert_parallel(objective.model, mesh["cp"])
    elif spec.ep > 1:
        shape = (spec.dp // spec.ep, spec.ep)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "ep"))
        shard_dims = ("dp", "ep")
        apply_expert_parallel(objective.model, mesh["ep"])
    elif world > 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    if activation_checkpointing:
        apply_activation_checkpointing(objective.model)
    if world == 1:
        return Layout()
    shard_model(objective, mesh, shard_dims=shard_dims, ep_dim=ep_dim)
    rank = dist.get_rank()
    return Layout(
        data_rank=rank // spec.cp,
        data_group=dist.group.WORLD,
        mesh=mesh,
        world=world,
        ep=spec.ep,
        cp=spec.cp,
        cp_group=mesh["cp"].get_group() if spec.cp > 1 else None,
    )
