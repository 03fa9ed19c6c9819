"""Apply the recipe's parallelism to the model, in the repository's fixed order: TP, EP, AC, FSDP.

Layouts (``dp * cp * tp`` ranks):

- ``dp`` ranks, each with its own rows of the global batch, FSDP2 over all of them;
- ``ep > 1``: the ranks form a ``(dp // ep, "dp") x (ep, "ep")`` mesh; every MoE's routed
  experts are split over ``"ep"`` (:func:`moe_parallel.apply_expert_parallel`; tokens travel to
  their experts' ranks and back), dense parameters are FSDP-sharded over all ranks, experts over
  ``"dp"`` only (:func:`fsdp_compat.shard_model` with ``ep_dim="ep"``);
- ``tp > 1``: a ``(dp, "dp") x (tp, "tp")`` mesh; :data:`TP_PLAN` splits attention heads and
  the shared expert over ``"tp"`` (:func:`moe_parallel.apply_tensor_parallel`, validated against
  the module tree); the ``tp`` ranks of a group hold the same rows; FSDP2 over ``"dp"``;
- ``cp > 1`` (needs packing): a ``(dp, "dp") x (cp, "cp")`` mesh; the ``cp`` ranks of a group
  share one packed row, each holding the pieces its layout assigns
  (:mod:`qwen35_trainer.packing`); FSDP2 over all ranks. With ``ep == cp`` the experts are split
  over the CP ranks (they hold different tokens, as EP needs) and FSDP-sharded over ``"dp"``.

Why the gradients are the one-process gradients: every rank backpropagates ``world * share``
of the global loss, ``world`` being the number of ranks with different tokens (``dp * cp``; see
:mod:`qwen35_trainer.train`). FSDP2 divides a dense gradient by the size of its reduce-scatter
group, which is exactly those ranks: the sum of the shares' gradients. TP peers compute the
same share; a TP-sharded weight's local gradient is its slice of the full one, a TP-replicated
weight's gradient is complete on every peer (the column-parallel input's backward all-reduces
over ``"tp"``), so nothing is summed over ``"tp"``. An expert's gradient on its owner already SUMS the contributions of the
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
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from fsdp_compat import shard_model
from moe_parallel import (
    apply_activation_checkpointing,
    apply_expert_parallel,
    apply_tensor_parallel,
)
from qwen35_trainer.model import moe_blocks
from qwen35_trainer.objective import TrainingObjective
from qwen35_trainer.recipe import ParallelRecipe

__all__ = ["TP_PLAN", "Layout", "check_layout", "parallelize"]

# Gated attention: q_proj emits [query | gate] per head, so a column shard of whole heads keeps
# each head's pair together; GQA keeps its ratio when heads and KV heads are both split. The
# per-head q/k RMSNorms see only this rank's heads, so their (replicated) weights get only a
# partial gradient: SequenceParallel over the head dim (2 of [B, S, heads, D]) makes the weight
# a Replicate DTensor whose gradient DTensor sums over "tp". The shared expert is an ordinary
# SwiGLU. Routed experts and routers are never TP-sharded (the plan is validated by
# moe_parallel); Gated DeltaNet layers, other norms, embeddings, lm_head and the vision tower
# stay replicated over TP.
TP_PLAN = {
    "model.language_model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.language_model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.language_model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.language_model.layers.*.self_attn.q_norm": SequenceParallel(
        sequence_dim=2, use_local_output=True
    ),
    "model.language_model.layers.*.self_attn.k_norm": SequenceParallel(
        sequence_dim=2, use_local_output=True
    ),
    "model.language_model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.language_model.layers.*.mlp.shared_expert.gate_proj": ColwiseParallel(),
    "model.language_model.layers.*.mlp.shared_expert.up_proj": ColwiseParallel(),
    "model.language_model.layers.*.mlp.shared_expert.down_proj": RowwiseParallel(),
}


@dataclasses.dataclass
class Layout:
    """Where this rank sits. ``data_rank``: which rows of the step it takes (its DP index);
    ``data_group``: the ranks holding different tokens of the global batch (all ranks but TP
    peers; ``None`` when that is one rank); ``cp_group``: the ranks sharing this rank's packed
    row (``None`` without CP)."""

    data_rank: int = 0
    data_group: Any = None
    world: int = 1  # shares of the global loss: dp * cp (TP peers hold the same tokens)
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
    ranks = spec.dp * spec.cp * spec.tp
    if min(spec.dp, spec.cp, spec.tp) < 1 or ranks != world:
        raise ValueError(
            f"parallel.dp={spec.dp} x parallel.cp={spec.cp} x parallel.tp={spec.tp} must equal "
            f"the launched world size {world} (WORLD_SIZE); launch with `torchrun "
            f"--nproc-per-node {ranks} ...` or change parallel.dp / cp / tp"
        )
    if spec.tp > 1 and (spec.cp > 1 or spec.ep > 1):
        raise ValueError(
            "parallel.tp > 1 together with parallel.cp or parallel.ep > 1 is not wired yet "
            "(it needs a 3-D mesh); use TP with data parallelism only"
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
    """TP, EP, activation checkpointing, then FSDP2, in place; returns this rank's
    :class:`Layout`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_layout(spec, world, packing=packing)
    mesh, shard_dims, ep_dim = None, ("dp",), "ep"
    if spec.tp > 1:
        mesh = init_device_mesh(device.type, (spec.dp, spec.tp), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(objective.model, mesh["tp"], TP_PLAN)
    elif spec.cp > 1:
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
    if spec.tp > 1:  # TP peers hold the same tokens: the data is split over "dp" only
        data_group = mesh["dp"].get_group() if spec.dp > 1 else None
        return Layout(mesh["dp"].get_local_rank(), data_group, world=spec.dp)
    return Layout(
        data_rank=dist.get_rank() // spec.cp,
        data_group=dist.group.WORLD,
        world=world,
        ep=spec.ep,
        cp=spec.cp,
        cp_group=mesh["cp"].get_group() if spec.cp > 1 else None,
    )
