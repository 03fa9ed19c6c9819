"""The compute of one planned rank and micro-batch: FLOPs of each kind, and how many times each
kind runs (the forward, the recompute of activation checkpointing, the backward).

FLOPs (:func:`qwen35_trainer.model.flops.forward_flops`): the forward of the rank's part of the
model over one micro-batch's row — its decoder layers; the vision tower on the first stage; the
``lm_head``, the MTP head on the last — then this rank's share of it:

- CP: ``1 / cp`` of every decoder kind: the row's tokens are split evenly, causal attention's
  pairs too (the zigzag split balances them); the tower's frames are split whole (frame
  sharding), so its busiest rank runs ``ceil(frames / cp)`` of them — all of one image's;
- TP: ``1 / tp`` of the projections, the shared expert and the attention / recurrence cores
  (whole heads per rank); the routed experts, the router-free ``fc`` and the loss see this TP
  rank's tokens: ``1 / tp`` of them under sequence parallelism, all of them without (replicated
  work); the tower is not TP-sharded;
- EP: none — each rank's experts compute the rows the EP group routed to them, on average its
  own tokens' share (natural routing's imbalance is in the experts' efficiency,
  :mod:`.timing`).

Documents: the synthetic stream's rows hold samples of its mean length (attention pairs are
per document); a dataset's documents are not known before its rows are packed, so each packed
row of ``pack_length`` is planned as one document (the most pairs). Images: the micro-batch's samples, each with
``images_per_sample`` of the largest grid (the planner's memory rows, :func:`.planner.row_shape`).

Passes, in forward-equivalents per micro-batch (:data:`PASSES`): 1 forward; +1 recompute for
the decoder blocks (and the MTP layer) under activation checkpointing, and for the tower when
it trains; +2 backward for a projection whose weights train (the input's gradient and the
weight's), +1 for a frozen one the gradient passes through (LoRA's base: the input's gradient
only), +2 for the attention and recurrence cores (no weights; their backward is twice the
forward's matmuls), 0 for a frozen tower (nothing before it trains). The MTP head's chunked
loss recomputes its logits in the backward: +1 for the MTP depths' share of ``loss``.
LoRA's adapters (rank ≪ width) are not counted.
"""

from __future__ import annotations

import dataclasses

from qwen35_trainer.data.synthetic import max_sample_tokens
from qwen35_trainer.model.flops import KINDS, forward_flops

__all__ = ["Work", "rank_work", "row_documents", "step_model_flops"]

_DECODER = ("attention", "attention_core", "gdn", "gdn_core", "shared_expert", "experts")
_CORES = ("attention_core", "gdn_core", "vision_core")
_TP_SHARDED = ("attention", "attention_core", "gdn", "gdn_core", "shared_expert")


@dataclasses.dataclass(frozen=True)
class Work:
    """One planned rank's compute per micro-batch (module docstring)."""

    forward: dict[str, float]  # this rank's forward FLOPs of each kind
    passes: dict[str, float]  # forward-equivalents each kind runs (forward, recompute, backward)
    units: int = 1  # FSDP units this rank gathers (the exposure rule of :mod:`.timing`)
    layer_share: float = 1.0  # of the decoder's layers, those this rank runs (PP: its stages')
    layers: int = 0  # decoder layers this rank runs
    full_layers: int = 0  # of them, full-attention layers
    recompute: float = 0.0  # 1 under activation checkpointing: the forward runs again

    def executed(self) -> dict[str, float]:
        """FLOPs each kind executes per micro-batch."""
        return {k: self.forward[k] * self.passes[k] for k in self.forward}


def row_documents(recipe, row: int) -> list[int]:
    """Document lengths of one packed row of ``row`` tokens (module docstring)."""
    data = recipe.data
    if data.dataset and data.pack_length and row > data.pack_length:
        rows, rest = divmod(row, data.pack_length)
        return [data.pack_length] * rows + ([rest] if rest else [])
    if data.dataset or not data.packing:
        return [row]
    merge = recipe.model.vision.get("spatial_merge_size", 2) ** 2
    image = max(t * h * w for t, h, w in data.image_grids) // merge + 2
    mean_text = (data.text_tokens[0] + data.text_tokens[1]) // 2
    doc = min(row, (data.images_per_sample + 1) * mean_text + data.images_per_sample * image)
    doc = min(doc, max_sample_tokens(recipe.model, data))
    return [doc] * (row // doc) + ([row % doc] if row % doc else [])


def _passes(recipe, last_mtp_share: float) -> dict[str, float]:
    lora = recipe.model.lora
    checkpointing = recipe.train.activation_checkpointing

    def trains(module: str) -> bool:
        return lora is None or module in lora.train_modules

    tower = trains("visual")
    weights_back = 2.0 if lora is None else 1.0
    passes = {}
    for kind in KINDS:
        if kind.startswith("vision"):
            recompute = float(checkpointing and tower)
            back = 2.0 if tower else 0.0
        else:
            recompute = float(checkpointing and kind in _DECODER)
            if kind in _CORES:
                back = 2.0
            elif kind == "loss":
                back = 2.0 if trains("lm_head") else 1.0
                recompute = last_mtp_share
            elif kind == "mtp":
                back = 2.0 if trains("mtp") else 1.0
            else:
                back = weights_back
        passes[kind] = 1.0 + recompute + back
    return passes


def rank_work(recipe, config, dims, shape, stage, units: int = 1) -> Work:
    """The :class:`Work` of a planned rank: ``shape`` its micro-batch's row
    (:class:`.memory.Shape`), ``stage`` its part of the model (:class:`.stages.StageView`),
    ``units`` the FSDP units it gathers."""
    text = config.text_config
    depth = getattr(text, "mtp_num_hidden_layers", 0) if stage.last else 0
    forward = forward_flops(
        config,
        row_documents(recipe, shape.row_tokens),
        [list(g) for g in shape.work_grids] if stage.first else [],
        layer_types=list(stage.layer_types),
        mtp=depth,
        head=stage.last,
    )
    tp, split = dims.tp, shape.sequence_split
    share = {k: 1 / dims.cp / (tp if k in _TP_SHARDED else 1) for k in KINDS}
    for kind in ("experts", "mtp", "loss"):
        share[kind] = 1 / dims.cp / split
    micro = sum(t * h * w for t, h, w in shape.grids)
    patches = shape.patches / max(micro, 1)  # the busiest rank's frames
    share |= {kind: patches for kind in KINDS if kind.startswith("vision")}
    mtp_share = depth / (depth + 1) if stage.last and depth else 0.0
    return Work(
        {k: v * share[k] for k, v in forward.items()},
        _passes(recipe, mtp_share),
        max(units, 1),
        len(stage.layer_types) / len(text.layer_types),
        len(stage.layer_types),
        sum(t == "full_attention" for t in stage.layer_types),
        float(recipe.train.activation_checkpointing),
    )


def step_model_flops(recipe, config, shape) -> float:
    """Model FLOPs of one step (the ``mfu`` convention: three forwards of the whole model, no
    recompute, a LoRA run's too): the row of every micro-batch of every data-parallel group."""
    docs = row_documents(recipe, shape.row_tokens)
    grids = [list(g) for g in shape.work_grids]
    per_row = 3.0 * sum(forward_flops(config, docs, grids).values())
    groups = recipe.parallel.dp_replicate * recipe.parallel.dp
    return per_row * recipe.train.grad_accum_steps * groups
