"""The tensor-parallel plan of the Qwen3.5 MoE-VLM decoder (data: module path → style).

Gated attention: ``q_proj`` emits [query | gate] per head, so a column shard of whole heads keeps
each head's pair together; GQA keeps its ratio when heads and KV heads are both split. The
per-head q/k RMSNorms see only this rank's heads, so their (replicated) weights would get only a
partial gradient: ``SequenceParallel`` over the head dim (2 of [B, S, heads, D]) makes the weight
a Replicate DTensor whose gradient DTensor sums over "tp". The shared expert is an ordinary
SwiGLU. Routed experts and routers are never TP-sharded (the plan is validated against the
module tree by :func:`moe_parallel.apply_tensor_parallel`, fail-closed).
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

__all__ = ["TP_PLAN"]

_LAYERS = "model.language_model.layers.*"

TP_PLAN = {
    f"{_LAYERS}.self_attn.q_proj": ColwiseParallel(),
    f"{_LAYERS}.self_attn.k_proj": ColwiseParallel(),
    f"{_LAYERS}.self_attn.v_proj": ColwiseParallel(),
    f"{_LAYERS}.self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    f"{_LAYERS}.self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    f"{_LAYERS}.self_attn.o_proj": RowwiseParallel(),
    f"{_LAYERS}.mlp.shared_expert.gate_proj": ColwiseParallel(),
    f"{_LAYERS}.mlp.shared_expert.up_proj": ColwiseParallel(),
    f"{_LAYERS}.mlp.shared_expert.down_proj": RowwiseParallel(),
}
