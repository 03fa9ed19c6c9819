"""A checkpoint folder as a weight source, read straight into this rank's shards: a transformers
directory (safetensors) or a torch Distributed Checkpoint folder of model state
(:func:`~qwen35_trainer.model.weights.files.open_files` tells them apart; both are read by row
spans, so what follows holds for either).

:class:`CheckpointSource` plans the whole load from metadata only (:class:`~qwen35_trainer.
model.weights.adapter.StateDictAdapter`: the on-disk tensors of each runtime tensor, their shapes
and dtypes) against the WHOLE model (:mod:`qwen35_trainer.model.weights.sources`): every missing
or mismatched tensor and every on-disk tensor no part of the model reads is a problem, while a
tensor another pipeline stage holds is checked like the rest and simply not read here. It
returns a reader for each parameter this rank holds; the parameter's local shard is then read
as the dim-0 span of its shard (:func:`~qwen35_trainer.model.weights.shards.read_local`), so
host memory holds this rank's shards plus one tensor's slice, and no byte of a tensor another
stage holds is read.

A parameter of a weight the model holds in FP8 reads the checkpoint's FP8 bytes or scales as
stored, or quantizes its values on load (:mod:`qwen35_trainer.model.fp8.load`); any other reads
the weight's values (an FP8 tensor dequantized).

The multi-token-prediction head (``mtp.*``, :mod:`qwen35_trainer.model.mtp`) loads strictly
like every other tensor. A checkpoint with no ``mtp.*`` tensor at all for a model with the head
is one clear error, unless ``init_missing_mtp``: then the head is left to the seeded
initialisation (logged); a model without the head skips the checkpoint's ``mtp.*`` tensors
(logged).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from qwen35_trainer.model.fp8.load import fp8_reader, fp8_role
from qwen35_trainer.model.lora.adapters import is_adapter
from qwen35_trainer.model.mtp import MTP_PREFIX
from qwen35_trainer.model.params import named_parameters
from qwen35_trainer.model.weights.adapter import StateDictAdapter
from qwen35_trainer.model.weights.files import open_files
from qwen35_trainer.model.weights.shards import local_index, read_local
from qwen35_trainer.model.weights.sources import RowReader, listed, plan_fill
from qwen35_trainer.model.weights.stored import Stored
from qwen35_trainer.model.whole import WholeParameter

__all__ = ["CheckpointSource", "load_hf_weights"]

logger = logging.getLogger("qwen35_trainer")


class CheckpointSource:
    """The weight source of checkpoint folder ``path`` (``block``: an FP8 checkpoint's
    ``weight_block_size``; ``window_bytes``: the safetensors reader's mapped window,
    :class:`~qwen35_trainer.model.weights.files.CheckpointFiles`). Module docstring."""

    def __init__(
        self,
        path: str | Path,
        *,
        block: tuple[int, int] | None = None,
        init_missing_mtp: bool = False,
        window_bytes: int | None = None,
    ) -> None:
        self.path = path
        self.block = block
        self.init_missing_mtp = init_missing_mtp
        self.window_bytes = window_bytes
        self.unfilled: list[str] = []  # the MTP head's names left to the seeded values
        self._unreadable = False

    def plan(self, whole: list[WholeParameter], problems: list[str]) -> dict[str, RowReader]:
        mtp = [p for p in whole if p.name.startswith(MTP_PREFIX)]
        try:
            files = open_files(self.path, window_bytes=self.window_bytes)
        except ValueError as err:
            self._unreadable = True
            problems.append(str(err))
            return {}
        float8 = [k for k in files.where if files.dtype(k) == "F8_E4M3"]
        if float8 and self.block is None:  # one reason for every float8 tensor: said once
            self._unreadable = True
            problems.append(
                f"checkpoint {self.path}: {len(float8)} tensor(s) are F8_E4M3 on disk (e.g. "
                f"{float8[0]}) but its config.json has no quantization_config giving their "
                "block size (weight_block_size): restore the checkpoint's quantization_config"
            )
            return {}
        adapter = StateDictAdapter(files, skipped=() if mtp else (MTP_PREFIX,), block=self.block)
        mtp_absent = bool(mtp) and not any(k.startswith(MTP_PREFIX) for k in files.where)
        if mtp_absent and self.init_missing_mtp:
            self.unfilled = [p.name for p in mtp if p.here]
            logger.warning(
                "checkpoint %s has no multi-token-prediction tensors (mtp.*): the MTP head's "
                "%d tensors start from the seeded initialisation (model.init_missing_mtp: true)",
                self.path,
                len(mtp),
            )
        elif mtp_absent:
            problems.append(
                f"no multi-token-prediction tensors (mtp.*) on disk for the model's "
                f"{_mtp_depth(whole)}-layer MTP head ({len(mtp)} tensors): set "
                "model.mtp_layers: 0 to train without it, or model.init_missing_mtp: true to "
                "start it from the seeded initialisation"
            )
        readers = {}
        stored: dict[str, Stored | None] = {}
        for p in whole:
            if (mtp_absent and p.name.startswith(MTP_PREFIX)) or is_adapter(p.name):
                continue  # LoRA adapters start name-seeded, never from the base checkpoint
            role = fp8_role(p.module, p.attr)
            weight = p.name if role is None else p.name.removesuffix(p.attr) + role.weight
            if weight not in stored:
                shape = tuple(p.param.shape) if role is None else role.shape
                stored[weight] = adapter.stored(weight, shape, problems)
            if stored[weight] is not None and p.here:
                found = stored[weight]
                readers[p.name] = found.values if role is None else fp8_reader(found, role)
        skipped, unexpected = adapter.unused()
        problems += [f"{key}: on disk, not in the model" for key in unexpected]
        if skipped and not problems:
            logger.info(
                "checkpoint %s: skipped %d multi-token-prediction tensors (mtp.*): the model "
                "has no MTP head (model.mtp_layers: 0)",
                self.path,
                len(skipped),
            )
        return readers

    def refusal(self, problems: list[str]) -> str:
        if self._unreadable:
            return problems[0]
        return (
            f"checkpoint {self.path} does not fit the recipe's model ({len(problems)} "
            f"tensor(s)): {listed(problems)}"
        )


def _mtp_depth(whole: list[WholeParameter]) -> int:
    """The MTP head's layer count (``mtp.layers.{i}``)."""
    return len({p.name.split(".")[2] for p in whole if p.name.startswith(f"{MTP_PREFIX}layers.")})


def load_hf_weights(
    model: nn.Module,
    path: str | Path,
    *,
    init_missing_mtp: bool = False,
    block: tuple[int, int] | None = None,
    window_bytes: int | None = None,
) -> list[str]:
    """Fill every parameter of ``model`` (materialised, sharded or not) from the transformers
    checkpoint directory ``path`` (``block``: an FP8 checkpoint's ``weight_block_size``);
    ``ValueError`` on every rank listing what does not fit. Returns the names left unfilled: the
    MTP head's when the checkpoint has none and ``init_missing_mtp`` (module docstring), else
    none."""
    params = list(named_parameters(model))
    device = params[0][3].device if params else torch.device("cpu")
    source = CheckpointSource(
        path, block=block, init_missing_mtp=init_missing_mtp, window_bytes=window_bytes
    )
    readers = plan_fill(model, [source], device)
    with torch.no_grad():
        for name, _, _, param in params:
            if name in readers:
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(read_local(readers[name], local_index(param)))
    return source.unfilled
