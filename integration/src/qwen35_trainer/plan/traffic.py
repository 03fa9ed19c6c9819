"""Bytes one rank sends in one optimizer step, by kind of collective (the plan's communication
table, and what :mod:`.timing` prices over NVLink or InfiniBand).

Ring collectives: a rank sends ``(n - 1) / n`` of the data of an all-gather or a
reduce-scatter over ``n`` ranks, twice that for an all-reduce; an all-to-all over ``n`` ranks
sends ``(n - 1) / n`` of its rows. ``b``: compute bytes (2 for bf16); gradients are reduced in
fp32. ``S``: this rank's tokens of a micro-batch's row, ``m`` the step's micro-batches,
``passes``: 3 under activation checkpointing (forward, recompute, backward), 2 without.

- ``fsdp_all_gather`` / ``fsdp_reduce_scatter`` (dense parameters over the ``dp × cp`` shard
  group) and ``expert_fsdp_*`` (each EP rank's experts over the remaining ``dp × cp / ep``):
  every parameter gathered for the forward and again for the backward (``2 · b`` bytes), every
  gradient reduce-scattered (4 bytes) — per micro-batch (FSDP2 reduces every backward
  completely, :func:`fsdp_compat.accumulating`), once per step under pipeline parallelism
  (torch's stages keep the units unsharded and reduce-scatter after the last backward,
  :mod:`.memory`);
- ``hsdp_all_reduce``: each shard's fp32 gradient all-reduced over the replicas, as often as
  the reduce-scatter;
- ``ep_all_to_all``: every layer's dispatch and combine of ``S · k`` rows of ``H``, per pass;
- ``cp_exchange``: every full-attention layer's K/V of the whole row, per pass;
- ``vision_gather``: the merged image tokens of the row gathered over CP (forward) and their
  gradient reduce-scattered (backward);
- ``tp`` (``tp > 1``): per layer and pass, the mixer's and the shared expert's input gathered
  and output reduce-scattered under sequence parallelism (or both outputs all-reduced without):
  four times ``S · H · b``;
- ``pp_p2p`` (added by the planner, :func:`.stages.p2p_bytes`): the stage boundaries' sends.

The per-micro-batch kinds (all but FSDP's and HSDP's) are ``m`` times one micro-batch's.
"""

from __future__ import annotations

__all__ = ["PER_MICROBATCH", "communication"]

# the kinds that happen inside every micro-batch (the rest once per FSDP reduction)
PER_MICROBATCH = ("ep_all_to_all", "cp_exchange", "vision_gather", "tp", "pp_p2p")


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def communication(
    model,
    dims,
    shape,
    layer_types=None,
    *,
    microbatches: int = 1,
    checkpointing: bool = True,
    pipelined: bool = False,
    tower: bool = True,
) -> dict[str, int]:
    """Bytes each rank sends in one step, by kind (module docstring); ``shape``: one
    micro-batch's row (:class:`.memory.Shape`); ``layer_types``: the decoder layers this rank
    runs (a pipeline stage's; default all); ``tower``: whether it runs the vision tower (under
    PP the first stage only)."""
    text = model.config.text_config
    layer_types = text.layer_types if layer_types is None else layer_types
    b, m = shape.compute_bytes, microbatches
    passes = 3 if checkpointing else 2
    reductions = 1 if pipelined else m
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts." in n)
    dense = sum(p.numel() for p in model.parameters()) - experts
    shard = dims.dp * dims.cp
    efsdp = shard // dims.ep
    expert_shard = experts / dims.ep
    traffic = {}
    if dims.dp_replicate > 1:
        local = dense / shard + expert_shard / efsdp
        traffic["hsdp_all_reduce"] = int(2 * local * 4 * _ring(dims.dp_replicate) * reductions)
    layers = len(layer_types)
    a2a = layers * shape.tokens * text.num_experts_per_tok * text.hidden_size
    full = sum(t == "full_attention" for t in layer_types)
    kv = 2 * text.num_key_value_heads * text.head_dim
    traffic |= {
        "fsdp_all_gather": int(2 * dense * b * _ring(shard) * reductions),
        "fsdp_reduce_scatter": int(dense * 4 * _ring(shard) * reductions),
        "expert_fsdp_all_gather": int(2 * expert_shard * b * _ring(efsdp) * reductions),
        "expert_fsdp_reduce_scatter": int(expert_shard * 4 * _ring(efsdp) * reductions),
        "ep_all_to_all": int(a2a * b * 2 * passes * _ring(dims.ep) * m),
        "cp_exchange": int(full * shape.row_tokens * kv * b * passes * _ring(dims.cp) * m),
        "vision_gather": int(
            shape.image_tokens * text.hidden_size * b * 2 * _ring(dims.cp) * m * tower
        ),
    }
    if dims.tp > 1:
        row = layers * shape.tokens * text.hidden_size * b
        traffic["tp"] = int(4 * row * passes * _ring(dims.tp) * m)
    return traffic
