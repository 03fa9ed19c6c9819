"""One sharding API over FSDP2 and megatron-fsdp 0.5/0.6.

- :func:`shard_model` — shard a model over named mesh dims (several are flattened once), with
  FSDP2 or megatron-fsdp, EP/TP-aware.
- :func:`shard_modules` — FSDP2 on a few modules of an otherwise unsharded model (each its own
  unit), e.g. to cast them for the compute.
- :func:`flatten_mesh` / :func:`get_mesh_dim` — mesh dims by name, flattened ones included.
- :class:`MixedPrecision` — one mixed-precision description for both backends.
- :func:`clip_grad_norm` — gradient clipping over parameters on several device meshes.
- :func:`accumulating` — backward passes inside add to the gradients (gradient accumulation);
  the next one outside completes the step's reductions, on either backend.
- :func:`finish_grad_sync` — complete the gradients before reading them (clipping): a no-op on
  FSDP2, megatron-fsdp's gradient sync on its wrapper.
- :func:`full_tensor` — the whole tensor of a parameter or gradient sharded by either backend.
- :func:`dcp_ready` — state dicts of either backend that ``torch.distributed.checkpoint``
  saves and loads as global tensors.
- :func:`release` — let a model FSDP2 sharded be freed with its last reference (its memory
  and its meshes' process groups), once it will not run again.
- :func:`build_megatron_call` — the megatron-fsdp call as data (function, keyword arguments).
"""

from fsdp_compat.accumulate import accumulating
from fsdp_compat.checkpoint import dcp_ready
from fsdp_compat.clip import clip_grad_norm
from fsdp_compat.gather import full_tensor
from fsdp_compat.megatron import (
    BackendSignatureError,
    build_megatron_call,
    check_megatron_tp_params,
    megatron_tp_shape_bug,
)
from fsdp_compat.megatron_optim import finish_grad_sync
from fsdp_compat.mesh import flatten_mesh, get_mesh_dim, mesh_dim_names_with_flattened
from fsdp_compat.precision import MixedPrecision
from fsdp_compat.release import release
from fsdp_compat.shard import BACKENDS, GRAD_REDUCTIONS, shard_model, shard_modules

__version__ = "0.3.0"

__all__ = [
    "BACKENDS",
    "GRAD_REDUCTIONS",
    "BackendSignatureError",
    "MixedPrecision",
    "__version__",
    "accumulating",
    "build_megatron_call",
    "check_megatron_tp_params",
    "clip_grad_norm",
    "dcp_ready",
    "finish_grad_sync",
    "flatten_mesh",
    "full_tensor",
    "get_mesh_dim",
    "megatron_tp_shape_bug",
    "mesh_dim_names_with_flattened",
    "release",
    "shard_model",
    "shard_modules",
]
