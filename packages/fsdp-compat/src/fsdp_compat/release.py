"""Let a sharded model go: its process groups' backends (each gloo group keeps three threads, one
of them waking every few milliseconds) end when the groups are destroyed, and the model is freed
with its last reference.

Measured on torch 2.15, gloo:

- FSDP2 caches each unit's process groups on its mesh infos (``shard_process_group``,
  ``replicate_process_group``), so a destroyed group's backend lives as long as any unit of the
  model. And a model that ran is not always freed when its last reference goes, even by
  ``gc.collect()``: the root's lazy initialisation links every unit through the shared state
  context (``all_states``) and the communication context (``post_forward_order``), and parts of
  a model that ran stay reachable only from C++ (autograd nodes, whose references the collector
  cannot follow). A trainer's model released this way after each of 5 runs in one process left
  no thread; without the release each run left its groups' threads (3 per group).
- DTensor keeps the meshes it has seen in caches without a bound (the sharding propagation's,
  the redistribution planners and plans, the mesh topology's).

:func:`release` empties the lists, detaches the cached groups from every unit and empties
DTensor's caches (they refill on the next op). It is for a model that will not run again: FSDP2's
next forward or backward would find neither its units nor its groups. megatron-fsdp keeps no such
structure on the module tree; its wrapper is left as it is.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import _redistribute
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

__all__ = ["release"]

# the FSDP2 internals emptied, as (attribute of the state, attribute of that object)
_RUNTIME_LISTS = (("_state_ctx", "all_states"), ("_comm_ctx", "post_forward_order"))


def release(model: nn.Module) -> None:
    """Free what ties ``model``'s FSDP2 units to each other and to their process groups, and
    DTensor's mesh caches (module docstring). Call it when the model will not run again, before
    destroying its groups. A unit that never ran has no run-time lists; a torch whose FSDP2
    lacks them is a ``RuntimeError`` naming them (the release would be silently incomplete)."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if state._is_root is not None:  # it ran: its lazy initialisation made the lists
            for owner, name in _RUNTIME_LISTS:
                runtime = getattr(getattr(state, owner, None), name, None)
                if not isinstance(runtime, list):
                    raise RuntimeError(
                        f"fsdp_compat.release: this torch's FSDP2 state has no list "
                        f"{owner}.{name} (an internal this release relies on; torch 2.15 has it)"
                    )
                runtime.clear()
        for group in state._fsdp_param_groups:
            for info in _mesh_infos(group):
                for name in [n for n in vars(info) if n.endswith("_process_group")]:
                    setattr(info, name, None)
    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def _mesh_infos(group) -> list:
    """The distinct mesh infos of an FSDP2 parameter group and of its parameters."""
    owners = [group, *group.fsdp_params]
    infos = [getattr(o, n, None) for o in owners for n in ("mesh_info", "post_forward_mesh_info")]
    return list({id(i): i for i in infos if i is not None}.values())
