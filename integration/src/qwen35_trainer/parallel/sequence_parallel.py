"""Sequence parallelism (SP): between the TP regions each TP rank holds 1/tp of the tokens.

Without SP the TP peers hold the same tokens everywhere, so the residual stream, the norms, the
routers and the routed experts compute the same thing ``tp`` times and keep ``tp`` copies of
their activations. With SP (``parallel.sequence_parallel``, on whenever ``tp > 1``) a run of
decoder layers — the decoder stack with its final norm, and each multi-token-prediction layer —
is a region whose
residual stream is split on the sequence dim over the TP ranks:

- entering the region (the first layer's input, whole on every TP peer): rank ``r`` keeps its
  ``r``-th slice; the backward all-gathers the slices' gradients (every peer needs the whole
  gradient of the replicated tensor it came from) — :func:`scatter_to_sequence`;
- inside, before a column-parallel region (attention's q/k/v, the shared expert, the TP-split
  Gated DeltaNet) the tokens are all-gathered; the backward reduce-scatters (each peer's heads
  contribute to every token's gradient) — :func:`gather_from_sequence` for the Gated DeltaNet,
  torch's ``PrepareModuleInput`` (``Shard`` → ``Replicate``) for the DTensor TP plan;
- after the row-parallel projections the partial outputs are reduce-scattered instead of
  all-reduced; the backward all-gathers — :func:`reduce_scatter_to_sequence`, torch's
  ``RowwiseParallel(output_layouts=Shard)``;
- leaving the region (the decoder's final norm's output, an MTP layer's output; the loss and
  everything after run on whole rows, as without SP, so nothing downstream changes): all-gather; the backward keeps this rank's slice of
  the gradient, which every peer computed whole — :func:`gather_replicated`. The router logits
  the aux loss reads leave the same way (:class:`qwen35_trainer.model.objective.RouterLogits`).

Tokens are split in equal contiguous slices of the CP rank's local sequence (packed rows, one
row; the row is padded so that every CP rank's tokens divide by ``tp``,
:attr:`qwen35_trainer.parallel.ParallelDims.row_multiple`).

The gradient rule (:func:`sum_sequence_parallel_grads`): a parameter the TP plan does not split
that runs inside a region (the layer norms and the decoder's final norm, the routers, the
shared-expert gates, the routed experts) now sees only this TP rank's tokens, so its local gradient is a partial sum; summed over
the TP group after the backward it is the whole gradient on every peer. The TP-split parameters'
gradients are unchanged by SP, and the TP-replicated ones that read whole sequences (the Gated
DeltaNet's fused q/k/v projection, convolution and norm, the per-head q/k norms) are summed over
TP already in the backward (:mod:`qwen35_trainer.parallel.tp_gdn`, DTensor).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "SequenceParallelGrads",
    "apply_sequence_parallel",
    "gather_from_sequence",
    "gather_replicated",
    "reduce_scatter_to_sequence",
    "region_parameters",
    "scatter_to_sequence",
    "sum_sequence_parallel_grads",
]


def _size_rank(group: Any) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    size, _ = _size_rank(group)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    size, rank = _size_rank(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"sequence parallelism: {x.shape[dim]} tokens on dim {dim} do not split over "
            f"{size} TP ranks"
        )
    parts = [p.contiguous() for p in x.chunk(size, dim=dim)]
    out = torch.empty_like(parts[rank])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _slice(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    size, rank = _size_rank(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"sequence parallelism: {x.shape[dim]} tokens on dim {dim} do not split over "
            f"{size} TP ranks (data.pack_length and the packed rows must be multiples of "
            "cp x tp)"
        )
    return x.chunk(size, dim=dim)[rank].contiguous()


class _ToSlice(torch.autograd.Function):
    """This TP rank's slice of the sequence: cut from ``x`` (whole on every peer) or, with
    ``reduce``, reduce-scattered (``x`` a partial sum on every peer); either way the backward
    all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce):
        ctx.group, ctx.dim = group, dim
        return (_reduce_scatter if reduce else _slice)(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, reduce_grad):
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return _reduce_scatter(grad, ctx.group, ctx.dim), None, None, None
        return _slice(grad, ctx.group, ctx.dim), None, None, None


def scatter_to_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """This TP rank's slice of ``x`` (whole on every peer); the backward all-gathers."""
    return _ToSlice.apply(x, group, dim, False)


def gather_from_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """The slices of every TP rank, concatenated; the backward reduce-scatters (each peer's
    gradient of the whole sequence is a partial sum: its heads' contribution)."""
    return _Gather.apply(x, group, dim, True)


def gather_replicated(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """The slices of every TP rank, concatenated, for a computation every peer repeats whole;
    the backward keeps this rank's slice of the (whole, equal) gradient."""
    return _Gather.apply(x, group, dim, False)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Partial results summed over the TP group, this rank keeping its slice; the backward
    all-gathers."""
    return _ToSlice.apply(x, group, dim, True)


def _enter(group: Any):
    def hook(module, args, kwargs):
        return (scatter_to_sequence(args[0], group), *args[1:]), kwargs

    return hook


def _leave(group: Any):
    def hook(module, args, kwargs, output):
        return gather_replicated(output, group)

    return hook


def sequence_parallel_regions(model: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module]]:
    """``(entry, exit, inside)`` of each SP region: the decoder stack with the final norm
    (entered at the first layer, left after the norm), and each MTP layer alone pipeline parallelism the stage holding the first layer enters, the stage holding
    the norm leaves, and the stages between pass each TP rank's slice on; a hook on a module
    another stage holds never runs)."""
    text = model.model.language_model
    regions = [(text.layers[0], text.norm, nn.ModuleList([text.layers, text.norm]))]
    if hasattr(getattr(model, "mtp", None), "layers"):  # not a pipeline stage's placeholder
        regions += [(layer, layer, layer) for layer in model.mtp.layers]
    return regions


def apply_sequence_parallel(model: nn.Module, group: Any) -> None:
    """Split each region's residual stream over ``group`` (module docstring): its entry scatters
    its input, its exit gathers its output. Applied to the layers as they will run (after
    activation checkpointing wraps them, so the gather is not recomputed)."""
    for entry, exit_, _ in sequence_parallel_regions(model):
        entry.register_forward_pre_hook(_enter(group), with_kwargs=True)
        exit_.register_forward_hook(_leave(group), with_kwargs=True)


def _on_tp_mesh(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and "tp" in (param.device_mesh.mesh_dim_names or ())


def region_parameters(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(module, name)`` of each trained parameter inside an SP region that the TP plan leaves
    whole: their gradients are summed over TP (module docstring). Called after TP and EP, before FSDP
    (whose sharding puts every parameter on a mesh and replaces it on the same module)."""
    found, seen = [], set()
    for _, _, inside in sequence_parallel_regions(model):
        for module in inside.modules():
            for name, param in module.named_parameters(recurse=False):
                trains = param.requires_grad  # a frozen (LoRA) weight has no gradient to sum
                if trains and id(param) not in seen and not _on_tp_mesh(param):
                    seen.add(id(param))
                    found.append((module, name))
    return found


class SequenceParallelGrads:
    """The parameters :func:`sum_sequence_parallel_grads` sums over the TP ``group``, given as
    :func:`region_parameters` found them (read when summed: FSDP replaces them)."""

    def __init__(self, owners: list[tuple[nn.Module, str]], group: Any) -> None:
        self.owners, self.group = owners, group

    @property
    def params(self) -> list[nn.Parameter]:
        return [getattr(module, name) for module, name in self.owners]


@torch.no_grad()
def sum_sequence_parallel_grads(sp: SequenceParallelGrads | None) -> None:
    """Sum the gradients of the SP regions' whole (non-TP) parameters over TP, in place (each
    FSDP shard: TP peers hold the same shards of them). One all-reduce per parameter dtype, in
    the same order on every rank; a parameter without a gradient adds zeros (every rank sends
    the same sizes)."""
    if sp is None:
        return
    owned = sp.params
    for dtype in sorted({p.dtype for p in owned}, key=str):
        params = [p for p in owned if p.dtype == dtype]
        local = [_local(p.grad) if p.grad is not None else None for p in params]
        sizes = [_local(p).numel() for p in params]
        flat = torch.cat(
            [
                t.reshape(-1) if t is not None else torch.zeros(n, dtype=dtype, device=p.device)
                for t, n, p in zip(local, sizes, params, strict=True)
            ]
        )
        dist.all_reduce(flat, group=sp.group)
        for t, part in zip(local, flat.split(sizes), strict=True):
            if t is not None:
                t.copy_(part.view_as(t))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
