"""Locate this rank's vocabulary slice when ``weight`` is a DTensor sharded on dim 0.

A DTensor ``Shard(0)`` over a mesh dim of size ``tp`` splits the rows like ``torch.chunk``:
every rank gets ``ceil(V / tp)`` rows except the last ones, which get the remainder or nothing.
So rank ``r`` owns ``[min(r·c, V), min((r+1)·c, V))`` with ``c = ceil(V / tp)``; the computed
size is checked against the actual local shard, so a layout this formula does not describe
raises instead of silently mis-indexing labels.

The weight (and bias) enter the loss through ``to_local()``, which is differentiable: the local
gradient comes back as a DTensor with the same placements, i.e. each rank's slice of the full
gradient. Other mesh dims must be ``Replicate`` (a weight that is also FSDP-sharded must be
gathered by FSDP's hooks first — see ``LinearCrossEntropy``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["VocabShard", "agree", "combine_lse", "combine_shards", "vocab_shard"]


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's local weight [V_r, H] / bias [V_r], its first row, V, and the TP group."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    start: int
    vocab: int
    group: dist.ProcessGroup | None


def _shard_dim(t: DTensor, name: str) -> int | None:
    shard_dims = []
    for dim, placement in enumerate(t.placements):
        if placement == Shard(0):
            shard_dims.append(dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"{name} DTensor placements must be Shard(0) on one mesh dim and Replicate on the "
                f"others, got {t.placements}"
            )
    if len(shard_dims) > 1:
        raise ValueError(
            f"{name} is sharded on dim 0 over {len(shard_dims)} mesh dims {t.placements}; the "
            "vocabulary may be split over one (TP) mesh dim only"
        )
    return shard_dims[0] if shard_dims else None


def vocab_shard(weight: DTensor, bias: torch.Tensor | None) -> VocabShard:
    """Split a DTensor ``weight`` [V, H] (and ``bias`` [V], a DTensor with the same layout)."""
    if bias is not None and not isinstance(bias, DTensor):
        raise TypeError(
            f"weight is a DTensor, so bias must be a DTensor with the same layout, got {type(bias).__name__}"
        )
    mesh_dim = _shard_dim(weight, "weight")
    if bias is not None and (
        bias.device_mesh != weight.device_mesh or tuple(bias.placements) != tuple(weight.placements)
    ):
        raise ValueError(
            f"bias must be laid out like weight (placements {weight.placements} on the same "
            f"mesh), got {bias.placements}"
        )
    local_w = weight.to_local()
    local_b = bias.to_local() if bias is not None else None
    vocab = weight.shape[0]
    if mesh_dim is None:
        return VocabShard(local_w, local_b, 0, vocab, None)
    mesh = weight.device_mesh
    tp, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    rows = -(-vocab // tp)
    start = min(rank * rows, vocab)
    size = min(rows, vocab - start)
    if local_w.shape[0] != size:
        raise ValueError(
            f"weight's local shard has {local_w.shape[0]} rows on TP rank {rank} of {tp}, expected "
            f"{size} for an even torch.chunk split of V = {vocab}"
        )
    return VocabShard(local_w, local_b, start, vocab, mesh.get_group(mesh_dim))


def agree(error: str | None, group: dist.ProcessGroup | None, fused: bool = False) -> None:
    """Raise ``ValueError`` on every rank of ``group`` if any rank found an error, or if the
    ranks resolved ``grad_in_forward`` differently (the two paths run different collectives, so
    a mix would hang); one all-reduce MAX of [error, fused, −fused]."""
    if group is None:
        if error is not None:
            raise ValueError(error)
        return
    flags = torch.tensor([0.0 if error is None else 1.0, float(fused), -float(fused)])
    backend = dist.get_backend(group)
    if backend == "nccl":
        flags = flags.cuda()
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    any_error, any_fused, not_all_fused = flags.tolist()
    if any_error > 0:
        raise ValueError(error or "another rank of the TP group rejected its loss inputs")
    if any_fused != -not_all_fused:
        raise ValueError(
            "the TP ranks resolved grad_in_forward differently (grad mode or requires_grad of "
            f"hidden/weight/bias differs between ranks; here it is {fused}); pass "
            "grad_in_forward explicitly or make the ranks agree"
        )


def combine_lse(max_C: torch.Tensor, sumexp_C: torch.Tensor, group) -> torch.Tensor:
    """The full-vocabulary log-sum-exp of a chunk from each shard's ``max`` and
    ``Σ exp(z − max)``, with ONE collective (an all-gather of [2, C] per rank):
    ``lse = M + log Σ_r sumexp_r · exp(max_r − M)`` with ``M = max_r max_r``. An empty shard
    sends ``(−inf, 0)`` and adds nothing."""
    stats_2C = torch.stack([max_C, sumexp_C])
    ranks = dist.get_world_size(group)
    gathered_XC = stats_2C.new_empty((ranks * 2, stats_2C.shape[1]))  # ranks' [2, C] stacked
    dist.all_gather_into_tensor(gathered_XC, stats_2C, group=group)
    max_RC, sumexp_RC = gathered_XC.view(ranks, 2, -1).unbind(1)
    top_C = max_RC.amax(dim=0)
    return top_C + (sumexp_RC * torch.exp(max_RC - top_C)).sum(dim=0).log()


def combine_shards(lse_M, target_M, zsum_M, group):
    """Full-vocabulary row statistics from per-shard ones: logsumexp over shards (max-shifted,
    an empty shard contributes lse = -inf, i.e. nothing), target logit and logit sum by SUM."""
    max_M = lse_M.clone()
    dist.all_reduce(max_M, op=dist.ReduceOp.MAX, group=group)
    max_M = torch.where(torch.isfinite(max_M), max_M, 0.0)
    stats_3M = torch.stack([torch.exp(lse_M - max_M), target_M, zsum_M])
    dist.all_reduce(stats_3M, op=dist.ReduceOp.SUM, group=group)
    return max_M + torch.log(stats_3M[0]), stats_3M[1], stats_3M[2]
