"""Turn on async TP (Inductor's micro-pipeline TP pass) for one TP group — or refuse, saying why.

The pass (``torch/_inductor/fx_passes/micro_pipeline_tp.py``) runs when
``torch._inductor.config._micro_pipeline_tp`` is set, and then rewrites a site only if
``torch.distributed`` has NCCL (or XCCL) and ``is_symm_mem_enabled_for_group(group)`` holds (a
symmetric-memory backend for the current accelerator and a registered group). Any missing piece
makes it skip the site without an error, so the flag alone proves nothing. This function checks
every piece up front, before changing any state, and raises with the missing piece named.

Sequence parallelism is stated by the caller: the pass fuses all-gather → matmul and
matmul → reduce-scatter, which are the collectives of TP *with* sequence parallel. Without SP the
TP linears communicate by all-reduce, which the pass never touches: enabling it would only add
compile time, so it is refused.

The checks depend only on the build, the device type and the group's backend, which are the same
on every rank of a TP group, so each rank reaches the same verdict without communicating.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["async_tp_refusal", "enable_async_tp"]


def async_tp_refusal(device_type: str) -> str | None:
    """Why async TP cannot run on a ``device_type`` mesh with this torch build, or ``None``.

    The checks a launcher can make before any process group exists (a trainer refusing a recipe
    up front); :func:`enable_async_tp` makes them again, plus the group's backend and symmetric
    memory."""
    if device_type not in ("cuda", "xpu"):
        return (
            f"async TP needs a CUDA (or XPU) mesh with NCCL (XCCL); tp_mesh is on "
            f"{device_type!r}. Inductor's pass skips every site without NCCL."
        )
    if not (dist.is_nccl_available() or dist.is_xccl_available()):
        return "this torch build has neither NCCL nor XCCL; async TP needs one of them"
    return None


def _group_backend(group: dist.ProcessGroup) -> str:
    return str(dist.get_backend(group)).lower()


def enable_async_tp(tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> str:
    """Enable async TP for ``tp_mesh``'s group; returns the group's name.

    Args:
        tp_mesh: the 1-D tensor-parallel mesh (e.g. ``world_mesh["tp"]``).
        sequence_parallel: whether the TP plan shards activations on the sequence dim between the
            TP regions (``SequenceParallel`` norms, ``ColwiseParallel(input_layouts=Shard(1))``,
            ``RowwiseParallel(output_layouts=Shard(1))``). Must be ``True``.

    Raises:
        TypeError / ValueError: bad arguments, or ``sequence_parallel=False``.
        RuntimeError: no CUDA/XPU mesh, no NCCL/XCCL backend on the group, or no symmetric memory
            for the group. The Inductor flag is left untouched when it raises.

    Call it before ``torch.compile``: the flag is read when graphs are compiled.
    """
    if not isinstance(tp_mesh, DeviceMesh):
        raise TypeError(
            f"enable_async_tp: tp_mesh must be a DeviceMesh, got {type(tp_mesh).__name__}"
        )
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"enable_async_tp: tp_mesh must be 1-D (the TP sub-mesh, e.g. mesh['tp']), got a "
            f"{tp_mesh.ndim}-D mesh with dims {tp_mesh.mesh_dim_names}"
        )
    if not isinstance(sequence_parallel, bool):
        raise TypeError(
            f"enable_async_tp: sequence_parallel must be a bool, got {type(sequence_parallel).__name__}"
        )
    if not sequence_parallel:
        raise ValueError(
            "enable_async_tp: async TP needs sequence parallel. The micro-pipeline TP pass fuses "
            "all-gather -> matmul and matmul -> reduce-scatter; without SP the TP linears use "
            "all-reduce, which it never fuses. Apply an SP plan and pass sequence_parallel=True."
        )
    refusal = async_tp_refusal(tp_mesh.device_type)
    if refusal is not None:
        raise RuntimeError(f"enable_async_tp: {refusal}")
    group = tp_mesh.get_group()
    backend = _group_backend(group)
    if "nccl" not in backend and "xccl" not in backend:
        raise RuntimeError(
            f"enable_async_tp: the TP group uses backend {backend!r}; async TP needs NCCL (or XCCL)"
        )
    from torch.distributed import _symmetric_memory as symm_mem

    group_name = group.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        # Deprecated (a no-op requirement) in recent torch, required by older releases.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
    if not symm_mem.is_symm_mem_enabled_for_group(group_name):
        raise RuntimeError(
            f"enable_async_tp: symmetric memory is not available for TP group {group_name!r} on "
            f"{tp_mesh.device_type} (no symmetric-memory backend for this device/build); the pass "
            "would skip every site"
        )
    from torch._inductor import config as inductor_config

    inductor_config._micro_pipeline_tp = True
    return group_name
