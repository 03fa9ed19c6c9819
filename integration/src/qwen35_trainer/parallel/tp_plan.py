"""The tensor-parallel plan of the Qwen3.5 MoE-VLM decoder (data: module path → style).

Gated attention: ``q_proj`` emits [query | gate] per head, so a column shard of whole heads keeps
each head's pair together; GQA keeps its ratio when heads and KV heads are both split. The
per-head q/k RMSNorms see only this rank's heads, so their (replicated) weights would get only a
partial gradient: ``SequenceParallel`` over the head dim (2 of [B, S, heads, D]) makes the weight
a Replicate DTensor whose gradient DTensor sums over "tp". The shared expert is an ordinary
SwiGLU. Routed experts and routers are never TP-sharded (the plan is validated against the
module tree by :func:`moe_parallel.apply_tensor_parallel`, fail-closed). The
multi-token-prediction head's layers (``mtp.layers.*``, full attention with the same MoE) get
the same styles (:func:`tp_plan`); its ``fc`` and norms stay replicated.

With sequence parallelism (``sequence_parallel=True``, :mod:`qwen35_trainer.parallel.
sequence_parallel`) a layer's input holds this TP rank's slice of the tokens: the attention's
input is all-gathered once (``PrepareModuleInput``: ``Shard(1)`` → ``Replicate``, kept a DTensor
so q, k and v read the same gathered tensor and the backward reduce-scatters their summed
gradient once) and ``o_proj`` reduce-scatters its partial sums (``Shard(1)``); the shared expert
reads the MoE's flattened tokens [N, H] the same way on dim 0.
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "TP_PLAN",
    "held_entries",
    "tp_linears",
    "tp_plan",
]


def _layer_plan(layers: str, sequence_parallel: bool = False) -> dict:
    plan = {
        f"{layers}.self_attn.q_proj": ColwiseParallel(),
        f"{layers}.self_attn.k_proj": ColwiseParallel(),
        f"{layers}.self_attn.v_proj": ColwiseParallel(),
        f"{layers}.self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        f"{layers}.self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        f"{layers}.self_attn.o_proj": RowwiseParallel(),
        f"{layers}.mlp.shared_expert.gate_proj": ColwiseParallel(),
        f"{layers}.mlp.shared_expert.up_proj": ColwiseParallel(),
        f"{layers}.mlp.shared_expert.down_proj": RowwiseParallel(),
    }
    if sequence_parallel:
        plan |= {
            f"{layers}.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            f"{layers}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            f"{layers}.mlp.shared_expert": PrepareModuleInput(
                input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)
            ),
            f"{layers}.mlp.shared_expert.down_proj": RowwiseParallel(output_layouts=Shard(0)),
        }
    return plan


TP_PLAN = _layer_plan("model.language_model.layers.*")


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict:
    """:data:`TP_PLAN` (with ``sequence_parallel``: its SP form), plus the same styles for the
    MTP head's layers when ``model`` has it."""
    plan = _layer_plan("model.language_model.layers.*", sequence_parallel)
    if hasattr(getattr(model, "mtp", None), "layers"):  # not a pipeline stage's placeholder
        plan |= _layer_plan("mtp.layers.*", sequence_parallel)
    return plan


def held_entries(model: nn.Module, plan: dict) -> dict:
    """The entries of ``plan`` matching a module ``model`` holds. A pipeline stage holds some
    layers only (a stage of Gated DeltaNet layers has no attention); without PP every entry
    must match, which :func:`moe_parallel.validate_tp_plan` checks."""
    names = [n for n, _ in model.named_modules() if n]
    return {k: v for k, v in plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}


def tp_linears(plan: dict) -> dict:
    """The entries of ``plan`` that shard a Linear (column- or row-parallel): what
    :func:`async_tp_linear.swap_tp_linears` turns into the fusable :class:`async_tp_linear.
    TPLinear` under ``parallel.async_tp``."""
    return {k: v for k, v in plan.items() if isinstance(v, ColwiseParallel | RowwiseParallel)}
