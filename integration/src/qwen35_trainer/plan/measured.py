"""What a real forward saves for the backward, measured: the planner's activations are checked
against it (``tests/test_plan.py``) and the sequence-parallelism benchmark reports it.

:func:`saved_activation_bytes` builds the recipe's training model on this rank (every rank of the
launch calls it), runs the objective's forward (under PP: the first stage's, on the ranks holding it) on step 0's
first micro-batch under
``torch.autograd.graph.saved_tensors_hooks`` and adds up the storages the autograd graph keeps,
each storage once, parameters left out (sharded, or FSDP-unsharded at that moment: a DTensor's
local part and the all-gathered tensor are both the parameter's, not an activation). Each
counted tensor is held until the forward ends: a storage saved and freed within it (a graph
branch dropped) would otherwise give its address to a later one, which would go uncounted.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["saved_activation_bytes"]


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage behind ``t``: a DTensor's local part, the tensor inside
    a functional collective's wrapper (``AsyncCollectiveTensor``)."""
    local = getattr(t, "_local_tensor", t)
    local = getattr(local, "elem", local)
    storage = local.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def saved_activation_bytes(recipe: Any, device: torch.device | None = None) -> dict[str, int]:
    """``{"rank", "saved"}``: the bytes this rank's forward saves for the backward."""
    from qwen35_trainer.data.feed import micro_batches
    from qwen35_trainer.model import build_training_model
    from qwen35_trainer.model.pipeline.stages import StepInputs
    from qwen35_trainer.train.step import count_targets

    device = device or torch.device("cpu")
    objective, layout = build_training_model(recipe, device)
    micro, _ = micro_batches(recipe, objective.model.config, layout, 0, device)
    valid, _ = count_targets(micro, layout, device)
    seen: dict[int, int] = {}
    held: list[torch.Tensor] = []  # a saved storage freed within the forward keeps its address

    def keep(t: torch.Tensor) -> torch.Tensor:
        # the parameters as they are NOW (FSDP unshards a unit's only while it runs)
        params = {_storage(p)[0] for p in objective.parameters()}
        address, size = _storage(t)
        if address not in params and address not in seen:
            seen[address] = size
            held.append(t)
        return t

    batch, packed = micro[0]
    rank = dist.get_rank() if dist.is_initialized() else 0
    pipe = objective.pipeline
    if pipe is not None:  # under PP: the first stage's forward of one micro-batch, on its ranks
        if not pipe.modules[0].first:
            return {"rank": rank, "saved": None}
        stage = pipe.modules[0]
        stage.inputs = StepInputs(micro, valid, (), lambda *shares: None, layout.loss_group)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            stage(torch.zeros(1, 1, dtype=torch.long, device=device))
        return {"rank": rank, "saved": sum(seen.values())}
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        objective(batch, layout.loss_group, packed, num_valid_tokens=valid)
    return {"rank": rank, "saved": sum(seen.values())}
