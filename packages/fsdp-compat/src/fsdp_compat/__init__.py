"""One sharding API over FSDP2 and megatron-fsdp 0.5/0.6.

- :func:`shard_model` — shard a model over named mesh dims (several are flattened once), with
  FSDP2 or megatron-fsdp, EP/TP-aware.
- :func:`flatten_mesh` / :func:`get_mesh_dim` — mesh dims by name, flattened ones included.
- :class:`MixedPrecision` — one mixed-precision description for both backends.
- :func:`clip_grad_norm` — gradient clipping over parameters on several device meshes.
- :func:`build_megatron_call` — the megatron-fsdp call as data (function, keyword arguments).
"""

from fsdp_compat.clip import clip_grad_norm
from fsdp_compat.megatron import (
    BackendSignatureError,
    build_megatron_call,
    check_megatron_tp_params,
    megatron_tp_shape_bug,
)
from fsdp_compat.mesh import flatten_mesh, get_mesh_dim, mesh_dim_names_with_flattened
from fsdp_compat.precision import MixedPrecision
from fsdp_compat.shard import BACKENDS, GRAD_REDUCTIONS, shard_model

__version__ = "0.2.0"

__all__ = [
    "BACKENDS",
    "GRAD_REDUCTIONS",
    "BackendSignatureError",
    "MixedPrecision",
    "__version__",
    "build_megatron_call",
    "check_megatron_tp_params",
    "clip_grad_norm",
    "flatten_mesh",
    "get_mesh_dim",
    "megatron_tp_shape_bug",
    "mesh_dim_names_with_flattened",
    "shard_model",
]
