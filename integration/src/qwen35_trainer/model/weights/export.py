"""Write the (sharded) model as a transformers checkpoint directory without gathering it.

Every rank computes the same plan from the WHOLE model's names and full shapes alone
(:func:`~qwen35_trainer.model.whole.whole_parameters`): tensors are dealt in module order to
the rank with the fewest bytes so far among those holding it — every rank, or under pipeline
parallelism the ranks of the stage that holds it, which alone gather it — and each rank's tensors
are cut into files of at most ``max_file_bytes``; the files are numbered
``model-00001-of-000NN.safetensors`` across all ranks. Then, tensor by tensor and in the same
order on every rank, a sharded parameter is reassembled (:func:`fsdp_compat.full_tensor`,
right for FSDP2's and megatron-fsdp's shards alike: one tensor at a
time, so memory is bounded by one tensor plus the file being filled) and kept only by its
owner, which writes each of its files as soon as it is full (readable as the folder's other
files are: :mod:`~qwen35_trainer.model.weights.saving`). Rank 0 writes the index
(``model.safetensors.index.json``) and ``config.json`` (with ``architectures`` and ``dtype``,
which servers read, and the fields they read that transformers leaves implicit:
:mod:`~qwen35_trainer.model.weights.served_config`). The tensors keep their runtime names; the routed experts are written
stacked (the runtime layout) or, with ``per_expert``, one tensor per expert and projection, as
transformers' ``save_pretrained`` and most published checkpoints hold them — both load in
``from_pretrained``. The multi-token-prediction head's experts are always per expert, as the
public checkpoints hold them (:func:`qwen35_trainer.model.weights.adapter.on_disk`; transformers
ignores ``mtp.*``, the inference servers' MTP loaders read it), and ``config.json`` states the
head's depth (``mtp_num_hidden_layers``). ``dtype`` casts every tensor as it is written. A
LoRA model (:mod:`qwen35_trainer.model.lora.adapters`) is written merged: each adapted weight as ``W +
s · B A`` (per expert for the routed experts), the adapters themselves not at all — the
folder is the trained function as a plain checkpoint. A base held in FP8 is dequantized first
(``W`` above), and its scales are not written. With ``fp8`` (:class:`FP8Export`) the weights
Qwen's FP8 releases convert are written quantized from those values (:func:`moe_parallel.
quantize`, per block ``amax / 448``) with their ``…_scale_inv`` beside them, per expert, and
``config.json`` carries the ``quantization_config``: the folder is served like those releases.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compat import full_tensor
from moe_parallel import quantize
from qwen35_trainer.model.fp8.hold import converted_form, dequantized
from qwen35_trainer.model.lora.adapters import is_adapter, merged
from qwen35_trainer.model.weights.adapter import on_disk
from qwen35_trainer.model.weights.saving import save_tensors
from qwen35_trainer.model.weights.served_config import complete_for_servers
from qwen35_trainer.model.weights.stored import SCALE_SUFFIX
from qwen35_trainer.model.whole import WholeParameter, whole_parameters

__all__ = ["FP8Export", "export_hf", "export_plan"]

logger = logging.getLogger("qwen35_trainer")

MAX_FILE_BYTES = 2 << 30
# transformers' class of the trained model (``type(model)`` is FSDP2's subclass of it once sharded)
ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"


def export_plan(
    entries: list[tuple[str, int]],
    world: int,
    max_file_bytes: int = MAX_FILE_BYTES,
    holders: list[list[int]] | None = None,
) -> list[tuple[int, int]]:
    """Per ``(name, bytes)`` entry: ``(owner rank, file number)``, file numbers counted from 1
    over all ranks (rank 0's files first); ``holders``: per entry, the ranks that may own it
    (default: every rank)."""
    owners, load = [], [0] * world
    for i, (_, size) in enumerate(entries):
        candidates = range(world) if holders is None else holders[i]
        rank = min(candidates, key=lambda r: (load[r], r))
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


@dataclasses.dataclass(frozen=True)
class FP8Export:
    """Write the converted weights (:func:`qwen35_trainer.model.fp8.hold.converted_form`) in
    block-scaled FP8 as Qwen's FP8 releases hold them: ``block``, scales in ``scale_dtype``,
    per expert, and ``quantization_config`` in ``config.json``."""

    block: tuple[int, int]
    scale_dtype: torch.dtype
    quantization_config: dict


def _pieces(name: str, shape, dtype, per_expert: bool, fp8: FP8Export | None):
    """``[(disk name, disk shape, dtype, part, take)]`` for runtime tensor ``name``: ``part``
    says which of the written values ``take`` cuts from (``"value"``, or an FP8 weight's
    ``"data"`` and ``"scale"``)."""
    form = converted_form(name, fp8.block) if fp8 is not None else None
    if form is None:
        return [
            (d, s, dtype, "value", t) for d, s, t in on_disk(name, shape, per_expert=per_expert)
        ]
    data = [
        (d, s, torch.float8_e4m3fn, "data", t) for d, s, t in on_disk(name, shape, per_expert=True)
    ]
    scales = on_disk(name, form.scale_shape(tuple(shape)), per_expert=True)
    return data + [(f"{d}{SCALE_SUFFIX}", s, fp8.scale_dtype, "scale", t) for d, s, t in scales]


def _values(name: str, full: torch.Tensor, fp8: FP8Export | None) -> dict[str, torch.Tensor]:
    form = converted_form(name, fp8.block) if fp8 is not None else None
    if form is None:
        return {"value": full}
    data, scale = quantize(full, form, scale_dtype=fp8.scale_dtype)
    return {"data": data, "scale": scale}


def export_hf(
    model: nn.Module,
    path: str | Path,
    *,
    max_file_bytes: int = MAX_FILE_BYTES,
    per_expert: bool = False,
    dtype: torch.dtype | None = None,
    fp8: FP8Export | None = None,
    pipeline_group: Any = None,
) -> None:
    """Every rank calls this (module docstring); returns when the directory is complete.
    ``dtype``: the tensors' dtype on disk (default: the parameters'); ``fp8``: the converted
    weights in FP8 instead (:class:`FP8Export`); ``pipeline_group``: under pipeline
    parallelism, this rank's pipeline group (each tensor is then written by a rank of the stage
    holding it)."""
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    params = [
        p
        for p in whole_parameters(model)
        if not is_adapter(p.name) and not p.name.endswith(SCALE_SUFFIX)
    ]
    dtype = dtype or next(p.param.dtype for p in params if p.param.dtype != torch.float8_e4m3fn)
    written = [_pieces(p.name, tuple(p.param.shape), dtype, per_expert, fp8) for p in params]
    entries = [
        (disk, math.prod(shape) * kind.itemsize)
        for pieces in written
        for disk, shape, kind, _, _ in pieces
    ]
    holders = _holders(params, world, pipeline_group)
    if holders is not None:  # per written entry: its parameter's holders
        holders = [h for h, pieces in zip(holders, written, strict=True) for _ in pieces]
    plan = export_plan(entries, world, max_file_bytes, holders)
    total = max((number for _, number in plan), default=0)
    places = iter(plan)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    pending: dict[str, torch.Tensor] = {}
    current = None
    for (name, module, attr, param, holder), pieces in zip(params, written, strict=True):
        if holder is not None:  # another pipeline stage's: its ranks write it
            for _ in pieces:
                next(places)
            continue
        full = merged(module, attr, full_tensor)
        full = dequantized(module, attr, full_tensor) if full is None else full
        full = full_tensor(param) if full is None else full
        values = _values(name, full.detach(), fp8)
        for disk, _, kind, part, take in pieces:
            owner, number = next(places)
            if owner != rank:
                continue
            if current is not None and number != current:
                save_tensors(pending, path / _file_name(current, total))
                pending = {}
            current = number
            pending[disk] = take(values[part]).to("cpu", kind, copy=True).contiguous()
    if pending:
        save_tensors(pending, path / _file_name(current, total))
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
        for note in complete_for_servers(config, model):
            logger.warning(note)
        if fp8 is not None:
            config.quantization_config = dict(fp8.quantization_config)
        config.save_pretrained(str(path))
    if dist.is_initialized():
        dist.barrier()


def _holders(
    params: list[WholeParameter], world: int, pipeline_group: Any
) -> list[list[int]] | None:
    """Per parameter, the global ranks holding it: those of the pipeline rank of its stage
    (every rank's pipeline rank gathered once, on the parameters' device); ``None`` without
    pipeline parallelism (every rank holds every tensor, sharded)."""
    if pipeline_group is None:
        return None
    device = next(p.param for p in params if p.here).device
    mine = torch.tensor([dist.get_rank(pipeline_group)], device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    stage_of = [int(t) for t in every]
    pp_rank = int(mine)
    return [
        [r for r in range(world) if stage_of[r] == (pp_rank if p.here else p.holder)]
        for p in params
    ]
