"""Write the (sharded) model as a transformers checkpoint directory without gathering it.

Every rank computes the same plan from the parameters' names and full shapes alone: tensors
are dealt in module order to the rank with the fewest bytes so far, and each rank's tensors
are cut into files of at most ``max_file_bytes``; the files are numbered
``model-00001-of-000NN.safetensors`` across all ranks. Then, tensor by tensor and in the same
order on every rank, a sharded parameter is reassembled (:func:`fsdp_compat.full_tensor`,
right for FSDP2's and megatron-fsdp's shards alike: one tensor at a
time, so memory is bounded by one tensor plus the file being filled) and kept only by its
owner, which writes each of its files as soon as it is full. Rank 0 writes the index
(``model.safetensors.index.json``) and ``config.json`` (with ``architectures`` and ``dtype``,
which servers read). The tensors keep their runtime names; the routed experts are written
stacked (the runtime layout) or, with ``per_expert``, one tensor per expert and projection, as
transformers' ``save_pretrained`` and most published checkpoints hold them — both load in
``from_pretrained``. The multi-token-prediction head's experts are always per expert, as the
public checkpoints hold them (:func:`qwen35_trainer.model.adapter.on_disk`; transformers
ignores ``mtp.*``, the inference servers' MTP loaders read it), and ``config.json`` states the
head's depth (``mtp_num_hidden_layers``). ``dtype`` casts every tensor as it is written. A
LoRA model (:mod:`qwen35_trainer.model.lora`) is written merged: each adapted weight as ``W +
s · B A`` (per expert for the routed experts), the adapters themselves not at all — the
folder is the trained function as a plain checkpoint.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compat import full_tensor
from qwen35_trainer.model.adapter import on_disk
from qwen35_trainer.model.lora import is_adapter, merged
from qwen35_trainer.model.params import named_parameters

__all__ = ["export_hf", "export_plan"]

MAX_FILE_BYTES = 2 << 30
# transformers' class of the trained model (``type(model)`` is FSDP2's subclass of it once sharded)
ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"


def export_plan(
    entries: list[tuple[str, int]], world: int, max_file_bytes: int = MAX_FILE_BYTES
) -> list[tuple[int, int]]:
    """Per ``(name, bytes)`` entry: ``(owner rank, file number)``, file numbers counted from 1
    over all ranks (rank 0's files first)."""
    owners, load = [], [0] * world
    for _, size in entries:
        rank = min(range(world), key=lambda r: (load[r], r))
        owners.append(rank)
        load[rank] += size
    local_file, filled, files = [0] * len(entries), [0] * world, [0] * world
    for i, (_, size) in enumerate(entries):
        rank = owners[i]
        if files[rank] == 0 or filled[rank] + size > max_file_bytes:
            files[rank] += 1
            filled[rank] = 0
        filled[rank] += size
        local_file[i] = files[rank]
    first = [1 + sum(files[:r]) for r in range(world)]
    return [(owners[i], first[owners[i]] + local_file[i] - 1) for i in range(len(entries))]


def _file_name(number: int, total: int) -> str:
    return f"model-{number:05d}-of-{total:05d}.safetensors"


def export_hf(
    model: nn.Module,
    path: str | Path,
    *,
    max_file_bytes: int = MAX_FILE_BYTES,
    per_expert: bool = False,
    dtype: torch.dtype | None = None,
) -> None:
    """Every rank calls this (module docstring); returns when the directory is complete.
    ``dtype``: the tensors' dtype on disk (default: the parameters')."""
    from safetensors.torch import save_file

    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    params = [
        (name, module, attr, param)
        for name, module, attr, param in named_parameters(model)
        if not is_adapter(name)
    ]
    dtype = dtype or params[0][3].dtype
    written = [on_disk(name, tuple(p.shape), per_expert=per_expert) for name, _, _, p in params]
    entries = [
        (disk, math.prod(shape) * dtype.itemsize)
        for tensors in written
        for disk, shape, _ in tensors
    ]
    plan = export_plan(entries, world, max_file_bytes)
    total = max((number for _, number in plan), default=0)
    places = iter(plan)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    pending: dict[str, torch.Tensor] = {}
    current = None
    for (_, module, attr, param), tensors in zip(params, written, strict=True):
        full = merged(module, attr, full_tensor)
        full = full_tensor(param) if full is None else full
        for disk, _, take in tensors:
            owner, number = next(places)
            if owner != rank:
                continue
            if current is not None and number != current:
                save_file(
                    pending, str(path / _file_name(current, total)), metadata={"format": "pt"}
                )
                pending = {}
            current = number
            pending[disk] = take(full).detach().to("cpu", dtype, copy=True).contiguous()
    if pending:
        save_file(pending, str(path / _file_name(current, total)), metadata={"format": "pt"})
    if rank == 0:
        weight_map = {
            disk: _file_name(number, total)
            for (disk, _), (_, number) in zip(entries, plan, strict=True)
        }
        index = {
            "metadata": {"total_size": sum(size for _, size in entries)},
            "weight_map": weight_map,
        }
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = copy.deepcopy(model.config)
        config.architectures = [ARCHITECTURE]
        config.dtype = dtype
        config.save_pretrained(str(path))
    if dist.is_initialized():
        dist.barrier()
