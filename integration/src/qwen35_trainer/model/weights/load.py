"""Read a transformers checkpoint directory straight into this rank's shards.

Every rank first plans the whole load from metadata only (:class:`~qwen35_trainer.model.
adapter.StateDictAdapter`: a reader per runtime tensor, every missing or mismatched tensor and
every unexpected on-disk one); the ranks agree on whether any of them found a problem (one
all-reduce on the group's device) and then all raise the same ``ValueError`` listing them, so
a bad checkpoint never leaves a rank waiting in a collective. Then each parameter's local
shard is read as the dim-0 span of its shard (:func:`~qwen35_trainer.model.weights.shards.read_local`)
and copied in: host memory holds this rank's shards plus one tensor's slice.

The multi-token-prediction head (``mtp.*``, :mod:`qwen35_trainer.model.mtp`) loads strictly
like every other tensor. A checkpoint with no ``mtp.*`` tensor at all for a model with the head
is one clear error, unless ``init_missing_mtp``: then the head's parameters are returned
unfilled (the caller initialises them, and it is logged); a model without the head skips the
checkpoint's ``mtp.*`` tensors (logged).
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
from qwen35_trainer.model.weights.adapter import CheckpointFiles, StateDictAdapter
from qwen35_trainer.model.weights.shards import local_index, read_local
from qwen35_trainer.model.weights.stored import Stored
from qwen35_trainer.parallel.dist import any_rank

__all__ = ["load_hf_weights", "plan_hf_load"]

logger = logging.getLogger("qwen35_trainer")


def load_hf_weights(
    model: nn.Module,
    path: str | Path,
    *,
    init_missing_mtp: bool = False,
    block: tuple[int, int] | None = None,
) -> list[str]:
    """Fill every parameter of ``model`` (materialised, sharded or not) from the transformers
    checkpoint directory ``path`` (``block``: an FP8 checkpoint's ``weight_block_size``);
    ``ValueError`` on every rank listing what does not fit. Returns the names left unfilled: the
    MTP head's when the checkpoint has none and ``init_missing_mtp`` (module docstring), else
    none."""
    params = list(named_parameters(model))
    device = params[0][3].device if params else torch.device("cpu")
    readers, unfilled = plan_hf_load(
        model, path, device, init_missing_mtp=init_missing_mtp, block=block
    )
    with torch.no_grad():
        for name, _, _, param in params:
            if name in readers:
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(read_local(readers[name], local_index(param)))
    return unfilled


def plan_hf_load(
    model: nn.Module,
    path: str | Path,
    device: torch.device,
    *,
    init_missing_mtp: bool = False,
    block: tuple[int, int] | None = None,
) -> tuple[dict, list[str]]:
    """``(readers, unfilled)``: a reader per parameter name of ``model`` (materialised or
    still on the meta device) from the checkpoint directory ``path`` (``block``: an FP8
    checkpoint's ``weight_block_size``), checked from metadata only — shapes and dtypes — and
    the names left to the caller (:func:`load_hf_weights`). A parameter of a weight the model
    holds in FP8 reads its bytes or scales (:mod:`qwen35_trainer.model.fp8.load`); any other
    reads the weight's values (an FP8 tensor dequantized). The ranks agree on whether any found
    a problem (one all-reduce on ``device``) and all raise the same ``ValueError``."""
    params = list(named_parameters(model))
    mtp = [name for name, _, _, _ in params if name.startswith(MTP_PREFIX)]
    problems: list[str] = []
    try:
        adapter = StateDictAdapter(
            CheckpointFiles(path), skipped=() if mtp else (MTP_PREFIX,), block=block
        )
    except ValueError as err:
        adapter, problems = None, [str(err)]
    readers = {}
    unfilled: list[str] = []
    if adapter is not None:
        mtp_absent = bool(mtp) and not any(k.startswith(MTP_PREFIX) for k in adapter.files.where)
        if mtp_absent:
            if init_missing_mtp:
                unfilled = mtp
            else:
                problems.append(
                    f"no multi-token-prediction tensors (mtp.*) on disk for the model's "
                    f"{model.config.text_config.mtp_num_hidden_layers}-layer MTP head ({len(mtp)} "
                    "tensors): set model.mtp_layers: 0 to train without it, or "
                    "model.init_missing_mtp: true to start it from the seeded initialisation"
                )
        stored: dict[str, Stored | None] = {}
        for name, module, attr, param in params:
            if (mtp_absent and name.startswith(MTP_PREFIX)) or is_adapter(name):
                continue  # LoRA adapters start name-seeded, never from the base checkpoint
            role = fp8_role(module, attr)
            weight = name if role is None else name.removesuffix(attr) + role.weight
            if weight not in stored:
                shape = tuple(param.shape) if role is None else role.shape
                stored[weight] = adapter.stored(weight, shape, problems)
            if stored[weight] is not None:
                readers[name] = (
                    stored[weight].values if role is None else fp8_reader(stored[weight], role)
                )
        skipped, unexpected = adapter.unused()
        problems += [f"{key}: on disk, not in the model" for key in unexpected]
    if any_rank(bool(problems), device):
        if adapter is None:
            raise ValueError(problems[0])
        where = "; ".join(problems[:20]) if problems else "(found by another rank)"
        more = f" ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(
            f"checkpoint {path} does not fit the recipe's model "
            f"({len(problems)} tensor(s) on this rank): {where}{more}"
        )
    if skipped:
        logger.info(
            "checkpoint %s: skipped %d multi-token-prediction tensors (mtp.*): the model has "
            "no MTP head (model.mtp_layers: 0)",
            path,
            len(skipped),
        )
    return readers, unfilled
