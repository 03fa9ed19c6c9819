"""Checkpoints of a sharded model through ``torch.distributed.checkpoint`` (DCP), either backend.

DCP asks every DTensor of a state dict which block of the global tensor its local shard holds
(its chunk metadata) and writes or reads that block. FSDP2's shards follow ``torch.chunk``'s
rule, which DTensor computes itself. megatron-fsdp's do not: a parameter's shard is the run of
rows its flat buffer's element range holds on the rank, so the rule puts them at the wrong
offsets (DCP refuses the save: its chunks do not cover the tensor) — the parameters' and the
optimizer state's alike. :func:`dcp_ready` gives each such DTensor its true block
(megatron-fsdp's own ``preprocess_state_dict_for_uneven_dtensor``: the ranks' local shapes
gathered, each rank's offset the sum of the rows before it, in rank order — the order of its
buffer), so the checkpoint holds the global tensors and any layout, FSDP2's included, can read
it. megatron-fsdp's own module hooks do the rest: ``state_dict`` puts its distributed parameters
in place, ``load_state_dict`` copies the loaded ones into the weights it computes with.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_compat.megatron_optim import megatron_wrapper

__all__ = ["dcp_ready"]


def dcp_ready(model: nn.Module, *state_dicts: dict) -> None:
    """Make ``state_dicts`` (of ``model`` and its optimizer, nested, DCP's input) describe
    their DTensor shards truly, in place (module docstring). Every rank calls it; on
    megatron-fsdp the ranks first agree that they hold the same DTensors (each one's shape is
    then gathered in turn: a rank lacking one would leave the others waiting) and otherwise all
    raise the same ``ValueError`` naming them. FSDP2: nothing to do."""
    if megatron_wrapper(model) is None:
        return
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    held = sorted(key for i, state in enumerate(state_dicts) for key in _dtensor_keys(state, (i,)))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, held)
    union = set().union(*map(set, every))
    missing = {
        r: sorted(union - set(keys)) for r, keys in enumerate(every) if len(keys) < len(union)
    }
    if missing:
        listed = "; ".join(
            f"rank {r} lacks {len(keys)}, e.g. {['.'.join(map(str, k[1:])) for k in keys[:3]]}"
            for r, keys in missing.items()
        )
        raise ValueError(
            "dcp_ready: the ranks' state dicts hold different DTensors (every rank's optimizer "
            f"must keep state for every parameter, its shard empty or not): {listed}"
        )
    for state in state_dicts:
        preprocess_state_dict_for_uneven_dtensor(state)


def _dtensor_keys(state: dict, prefix: tuple):
    """The key paths of the DTensors in the nested dict ``state``, each after ``prefix``."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _dtensor_keys(value, (*prefix, str(key)))
        elif isinstance(value, DTensor):
            yield (*prefix, str(key))
