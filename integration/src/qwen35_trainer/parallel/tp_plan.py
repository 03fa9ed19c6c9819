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
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

__all__ = ["TP_PLAN", "tp_plan"]


def _layer_plan(layers: str) -> dict:
    return {
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


TP_PLAN = _layer_plan("model.language_model.layers.*")


def tp_plan(model: nn.Module) -> dict:
    """:data:`TP_PLAN`, plus the same styles for the MTP head's layers when ``model`` has it."""
    return {**TP_PLAN, **_layer_plan("mtp.layers.*")} if hasattr(model, "mtp") else TP_PLAN
