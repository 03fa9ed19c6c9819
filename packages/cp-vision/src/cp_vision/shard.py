"""Run a vision tower on this rank's frames and reassemble the full output on every rank.

Why it is exact: the tower maps each frame independently (attention inside a frame, spatial
position embeddings, a merger that folds patches of one frame), so ``vision_fn`` on a contiguous
range of frames returns exactly the rows the full run would produce for them (see
:mod:`cp_vision.plan`), and the variable-length all-gather concatenates the ranks' ranges in
order. Backward: every rank's loss reads the gathered output; the gather's backward sums all
ranks' gradients for a rank's rows and hands them to that rank (:class:`VarlenAllGather`), so
each rank's parameter gradient is the gradient of the total loss restricted to its frames, and
the usual gradient sum over the group (DDP / FSDP over the CP ranks) yields the replicated
run's summed gradient. Dummy frames feed a token that is dropped: their gradient is zero.

Scope: that sum is right only when the group's ranks hold different losses. TP ranks of one
CP rank compute the same loss, so summing over them would count the vision gradient tp times:
a trainable tower is sharded over the CP group only, a frozen one (no backward) may use CP×TP.

Agreement: inputs and the local outputs are checked on every rank and the verdicts combined by
a tiny all-reduce before anyone raises, so a bad or divergent rank makes every rank raise
instead of leaving peers blocked in the gather.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cp_vision.gather import varlen_all_gather
from cp_vision.plan import FramePlan, plan_frames

__all__ = ["run_vision_sharded"]

VisionFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_TP_TRAINABLE_ERROR = (
    "a trainable vision tower cannot be sharded over a group that spans TP replicas: the TP "
    "ranks of one CP rank compute the same loss, so the gather's backward (a sum over the group) "
    "would add every frame's gradient once per TP replica and the vision gradient would be "
    "counted tp times. Shard a trainable tower over the CP group only (each TP rank then "
    "encodes its CP slice), or run a frozen tower (trainable=False) over CP×TP."
)
_HASH_MOD = (1 << 61) - 1


def _fingerprint(values: list[int]) -> int:
    """A polynomial hash of ``values`` (equal inputs give equal numbers on every rank)."""
    h = len(values)
    for v in values:
        h = (h * 1_000_003 + v) % _HASH_MOD
    return h


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The device a collective on ``group`` needs: CPU when the group has a CPU backend (gloo,
    or e.g. ``"cpu:gloo,cuda:nccl"``), else the current CUDA device (NCCL)."""
    backend = str(dist.get_backend(group)).lower()
    if "cpu:" in backend or any(name in backend for name in ("gloo", "mpi", "fake")):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _agree(group: dist.ProcessGroup, failed: bool, facts: list[int], what: str) -> None:
    """One all-reduce of every rank's verdict and ``facts``; afterwards every rank knows.

    A rank that did not fail raises ``ValueError`` when another rank failed or when the ranks'
    ``facts`` differ; a rank that failed returns and raises its own error.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    verdicts = [0] * world
    verdicts[rank] = int(failed)
    flag = torch.tensor(verdicts + facts + [-f for f in facts], dtype=torch.int64)
    flag = flag.to(group_device(group))  # NCCL groups take CUDA tensors only
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    flag = flag.cpu()
    if failed:
        return
    bad = [r for r in range(world) if flag[r]]
    if bad:
        raise ValueError(f"{what}: rank(s) {bad} of the group failed (see their error)")
    n = len(facts)
    hi, lo = flag[world : world + n], -flag[world + n :]
    if not torch.equal(hi, lo):
        raise ValueError(
            f"{what}: the ranks of the group disagree (max over ranks {hi.tolist()}, min "
            f"{lo.tolist()}); every rank must pass the same grid_thw, pixel_values shape, plan, "
            f"trainable and tp_replicated, and its tower must return the same width and dtype"
        )


def _resolve_group(group: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup:
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group as a DeviceMesh must be 1-D, got dims {group.mesh_dim_names} of shape "
                f"{tuple(group.shape)}: pass the CP sub-mesh, or flatten CP×TP (frozen tower "
                f"only) and pass tp_replicated=True"
            )
        return group.get_group()
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}"
        )
    return group


def _check_inputs(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, plan: FramePlan | None, world: int
) -> FramePlan:
    if not isinstance(pixel_values, torch.Tensor):
        raise TypeError(
            f"pixel_values must be a tensor [total_patches, C·T·P·P], got {type(pixel_values).__name__}"
        )
    if pixel_values.dim() != 2:
        raise ValueError(
            "pixel_values must be 2-D [total_patches, C·T·P·P], got shape "
            f"{tuple(pixel_values.shape)}"
        )
    if not isinstance(grid_thw, torch.Tensor):
        raise TypeError(
            f"grid_thw must be a tensor [n_images_or_videos, 3], got {type(grid_thw).__name__}"
        )
    if plan is None:
        plan = plan_frames(grid_thw, world)
    elif not isinstance(plan, FramePlan):
        raise TypeError(f"plan must be a FramePlan from plan_frames, got {type(plan).__name__}")
    elif plan.world_size != world or plan.grid_thw != tuple(map(tuple, grid_thw.tolist())):
        raise ValueError(
            f"plan was made for world {plan.world_size} and grid_thw {list(plan.grid_thw)}, "
            f"called with group size {world} and grid_thw {grid_thw.tolist()}"
        )
    if pixel_values.shape[0] != plan.num_pixel_rows:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[0]} rows, grid_thw {list(plan.grid_thw)} "
            f"needs sum(t·h·w) = {plan.num_pixel_rows}"
        )
    return plan


def _local_run(
    vision_fn: VisionFn, pixel_values: torch.Tensor, grid_thw: torch.Tensor, expected_rows: int
) -> tuple[torch.Tensor | None, Exception | None]:
    """Run the tower; return its output, or the exception that makes it unusable here."""
    try:
        out = vision_fn(pixel_values, grid_thw)
    except Exception as exc:  # raised again on this rank once the peers know
        return None, exc
    if not isinstance(out, torch.Tensor):
        return None, TypeError(
            f"vision_fn must return the merged tokens as a tensor [N_tokens, D], got "
            f"{type(out).__name__} (for a transformers tower use e.g. "
            f"lambda pv, g: tower(pv, g).pooler_output)"
        )
    if out.dim() != 2 or out.shape[0] != expected_rows:
        return None, ValueError(
            f"vision_fn returned shape {tuple(out.shape)} for local grid_thw {grid_thw.tolist()}; "
            f"expected [{expected_rows}, D] (h·w / spatial_merge_size² tokens per frame)"
        )
    return out, None


def run_vision_sharded(
    vision_fn: VisionFn,
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    group: dist.ProcessGroup | DeviceMesh | None,
    *,
    trainable: bool,
    plan: FramePlan | None = None,
    tp_replicated: bool = False,
) -> torch.Tensor:
    """Encode this rank's frames and return the full tower output, identical on every rank.

    Args:
        vision_fn: ``vision_fn(pixel_values [rows, C·T·P·P], grid_thw [n, 3]) -> [tokens, D]``,
            the merged tokens in input order (for transformers' ``Qwen3_5MoeVisionModel``:
            ``lambda pv, g: tower(pv, g).pooler_output``).
        pixel_values: ``[sum(t·h·w), C·T·P·P]``, the same on every rank of ``group``.
        grid_thw: ``[n_images_or_videos, 3]`` integer ``(t, h, w)``, the same on every rank.
        group: the ranks that share the work: a ProcessGroup, a 1-D DeviceMesh, or ``None``
            for the default group. Size 1 runs ``vision_fn`` on everything.
        trainable: ``True`` keeps the autograd graph (the gather's backward sums the group's
            gradients); ``False`` runs everything under ``torch.no_grad()``.
        plan: a :func:`plan_frames` result for this ``grid_thw`` and group size; by default one
            is made with Qwen3.5's cost model and spatial merge size 2.
        tp_replicated: ``True`` when ``group`` spans TP replicas (e.g. a flattened CP×TP mesh);
            allowed only for a frozen tower.

    Returns:
        ``[N_tokens, D]``: what ``vision_fn(pixel_values, grid_thw)`` returns.

    Raises:
        ValueError: on every rank, when the combination is unsupported (trainable over TP
        replicas), when a rank's input or tower output is malformed, or when ranks disagree.
        An exception from ``vision_fn`` is raised again on its rank; its peers raise ValueError.
    """
    pg = _resolve_group(group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    error: Exception | None = None
    facts = [int(bool(trainable)), int(bool(tp_replicated))]
    try:
        local_plan = _check_inputs(pixel_values, grid_thw, plan, world)
        if trainable and tp_replicated and world > 1:
            raise ValueError(_TP_TRAINABLE_ERROR)
        grid_values = [v for row in local_plan.grid_thw for v in row]
        # The cut itself is agreed too: plans made with different cost models would mis-pair rows.
        cuts = [v for r in local_plan.unit_ranges for v in r] + [local_plan.spatial_merge_size]
        facts += [_fingerprint(grid_values), *pixel_values.shape, _fingerprint(cuts)]
    except (TypeError, ValueError) as exc:
        error = exc
        facts += [0, 0, 0, 0]
    if world > 1:
        _agree(pg, error is not None, facts, "run_vision_sharded inputs")
    if error is not None:
        raise error

    with contextlib.nullcontext() if trainable else torch.no_grad():
        if world == 1:
            out, error = _local_run(vision_fn, pixel_values, grid_thw, local_plan.num_tokens)
            if error is not None:
                raise error
            return out
        if local_plan.is_dummy(rank):
            m = local_plan.spatial_merge_size
            local_pixels = pixel_values.new_zeros((m * m, pixel_values.shape[1]))
        else:
            start, end = local_plan.pixel_ranges[rank]
            local_pixels = pixel_values[start:end]
        local_grid = torch.tensor(
            local_plan.local_grids[rank], dtype=grid_thw.dtype, device=grid_thw.device
        )
        counts = [local_plan.local_token_count(r) for r in range(world)]
        out, error = _local_run(vision_fn, local_pixels, local_grid, counts[rank])
        facts = (
            [-1, -1] if out is None else [out.shape[1], _fingerprint(list(str(out.dtype).encode()))]
        )
        _agree(pg, error is not None, facts, "run_vision_sharded tower outputs")
        if error is not None:
            raise error
        gathered_ND = varlen_all_gather(out, counts, pg)
        offsets = [sum(counts[:r]) for r in range(world)]
        real = [r for r in range(world) if not local_plan.is_dummy(r)]
        if len(real) == world:
            return gathered_ND
        # Dummy ranks' tokens are dropped; their gradient is therefore zero.
        return torch.cat([gathered_ND[offsets[r] : offsets[r] + counts[r]] for r in real])
