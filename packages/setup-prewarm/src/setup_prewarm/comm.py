"""Communicator prewarm: one small all-reduce on every distinct process group.

NCCL creates a communicator (and its buffers, outside PyTorch's caching allocator) on the first
collective of each process group. Touching every group once at setup moves that allocation out
of the first training step. The groups are the ones a model's DTensor parameters live on — every
dim of every parameter's ``device_mesh`` (a mesh made by ``DeviceMesh._flatten`` is a 1-D mesh of
its own and is found the same way) — plus groups or meshes passed explicitly.

Correctness argument:
- exactly once: groups are keyed by ``ProcessGroup.group_name``, unique per created group, so a
  group reached through several parameters, meshes or explicit arguments is all-reduced once;
- no deadlock: every rank walks the parameters in the same module order, the meshes' dims in
  order and the explicit groups in the order given, so every member of a group reaches its
  all-reduce at the same position in its sequence. A group whose all-reduce raises does not stop
  the walk: the rank goes on with the later groups its peers are waiting in, and the errors are
  raised together at the end;
- health check: each rank contributes 1, so the sum must equal the group size; a wrong sum is
  an error naming the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["GroupTarget", "collect_groups", "warm_groups"]


@dataclasses.dataclass(frozen=True)
class GroupTarget:
    """A process group to touch, where it came from (``label``) and the device type of its
    tensors (``"cuda"`` for NCCL meshes/groups, ``"cpu"`` for gloo)."""

    group: dist.ProcessGroup
    label: str
    device_type: str

    @property
    def key(self) -> str:
        return self.group.group_name


def _mesh_targets(mesh: DeviceMesh) -> list[GroupTarget]:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return [
        GroupTarget(group, name, mesh.device_type)
        for name, group in zip(names, mesh.get_all_groups(), strict=True)
    ]


def _group_target(group: dist.ProcessGroup) -> GroupTarget:
    backend = str(dist.get_backend(group))
    device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    return GroupTarget(group, group.group_name, device_type)


def collect_groups(
    model: nn.Module | None, groups: Iterable[dist.ProcessGroup | DeviceMesh] = ()
) -> list[GroupTarget]:
    """The distinct groups used by ``model``'s DTensor parameters, then those in ``groups``.

    ``groups`` holds ``ProcessGroup`` objects and/or ``DeviceMesh`` objects (a mesh stands for
    all of its dims). The order is deterministic: parameters in ``named_parameters`` order, mesh
    dims in order, then ``groups`` in order; the first sighting of a group gives its label.
    """
    targets: list[GroupTarget] = []
    if model is not None:
        for param in model.parameters():
            if isinstance(param, DTensor):
                targets.extend(_mesh_targets(param.device_mesh))
    for item in groups:
        if isinstance(item, DeviceMesh):
            targets.extend(_mesh_targets(item))
        else:
            targets.append(_group_target(item))
    unique: dict[str, GroupTarget] = {}
    for target in targets:
        unique.setdefault(target.key, target)
    return list(unique.values())


def warm_groups(targets: Sequence[GroupTarget], device: torch.device) -> str:
    """All-reduce a one-element tensor of ones on each target; check the sum is the group size.

    NCCL targets use ``device`` when it is a CUDA device, else the current CUDA device. Returns a
    one-line summary; raises ``RuntimeError`` listing every group that failed (after all groups
    were attempted).
    """
    errors: list[str] = []
    for target in targets:
        if target.device_type == "cuda":
            on = (
                device
                if device.type == "cuda"
                else torch.device("cuda", torch.cuda.current_device())
            )
        else:
            on = torch.device("cpu")
        try:
            ones = torch.ones(1, device=on, dtype=torch.float32)
            dist.all_reduce(ones, group=target.group)
            expected = dist.get_world_size(target.group)
            if ones.item() != expected:
                errors.append(
                    f"{target.label}: sum of ones is {ones.item()}, group size {expected}"
                )
        except Exception as exc:
            errors.append(f"{target.label}: {type(exc).__name__}: {exc}")
    if errors:
        raise RuntimeError(
            f"{len(errors)} of {len(targets)} group all-reduces failed: " + "; ".join(errors)
        )
    sizes = ", ".join(f"{t.label}({dist.get_world_size(t.group)})" for t in targets)
    return f"all-reduced {len(targets)} group(s): {sizes}"
