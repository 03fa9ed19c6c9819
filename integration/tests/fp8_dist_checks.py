"""The FP8-base layout check run on every rank of test_train_dp.py's gloo launches."""

from __future__ import annotations

import torch.distributed as dist
from dist_checks import assert_same_run, layout_recipe
from torch.distributed.fsdp import FSDPModule

from qwen35_trainer import train


def _unit_bytes(model, trained_bytes: int) -> set[int]:
    """What one all-gather of each FSDP unit of ``model`` (sharded over more than one rank)
    carries if every frozen parameter travels in its storage dtype (FP8 one byte, the scales
    four, the rest of the base as stored) and every trained one in ``trained_bytes`` (the
    compute dtype): the padded shards of its parameters (FSDP2's own shard sizes), times the
    shard group's size."""
    sizes = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group  # torch internals: test-only
        if group is None or group.mesh_info.shard_mesh_size == 1:  # nothing to gather
            continue
        shard = sum(
            p.padded_sharded_param_size.numel()
            * (trained_bytes if p.sharded_param.requires_grad else p.sharded_param.dtype.itemsize)
            for p in group.fsdp_params
        )
        sizes.add(shard * group.mesh_info.shard_mesh_size)
    return sizes


def check_fp8_equals_one_process(overrides, reference_logs, reference_state, compare=None) -> None:
    """The FP8-base LoRA layout ``overrides`` equals one process (its loss, CE, aux loss and
    gradient norm per step, and the parameters — the FP8 bytes and scales unchanged), and
    FSDP all-gathers each unit with its frozen parameters as stored: every gather carries one
    unit's FP8 bytes and scales as they are and its adapters in the compute dtype (no bf16 or
    fp32 copy of an FP8 weight), and every unit is gathered."""
    gathered: list[int] = []
    original = dist.all_gather_single

    def recorded(out, inp, *args, **kwargs):
        gathered.append(out.numel() * out.element_size())
        return original(out, inp, *args, **kwargs)

    dist.all_gather_single = recorded
    try:
        result = train(layout_recipe(dist.get_world_size(), *overrides))
    finally:
        dist.all_gather_single = original
    recipe = layout_recipe(dist.get_world_size(), *overrides)
    units = _unit_bytes(result.objective, 2 if recipe.train.dtype == "bfloat16" else 4)
    assert units and set(gathered) == units, (sorted(set(gathered)), sorted(units))
    state = result.objective.model.state_dict()
    assert_same_run(result.logs, reference_logs, state, reference_state, **(compare or {}))
