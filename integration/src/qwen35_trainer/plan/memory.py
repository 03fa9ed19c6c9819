"""Bytes per rank and per step, from the parallelised meta model and the recipe.

Exact (counted from this rank's DTensor shards, equal to a real run's tensors):

- ``parameters``: every local shard in its storage dtype (fp32 master weights; a LoRA run's
  frozen base in bf16 under bf16 compute, :func:`qwen35_trainer.model.lora.adapters.store_frozen`);
- ``gradients``: the shards that train (FSDP2 keeps sharded fp32 gradients; with LoRA the
  adapters only);
- ``optimizer``: AdamW / TE fused Adam: two fp32 moments per local element that trains, plus
  one 4-byte step counter per trained parameter tensor.

Modelled (the formulas are stated where they are computed; ``b`` = compute bytes, 2 for bf16;
``S`` = tokens on this rank = ``pack_length / cp``; the tests compare the saved activations
with a real run's saved tensors):

- ``activations``: what the forward saves for the backward. Under sequence parallelism the
  decoder stack and the MTP layers hold ``S / tp`` tokens (the ``sequence_split``): their
  checkpointed inputs, the final norm's and the router logits shrink by ``tp``, and without
  checkpointing the MoE's rows and the norms. With activation checkpointing
  (:func:`saved_with_checkpointing`): each decoder block's input ``S·H·b``, each vision
  block's ``P·Hv·b`` (``P`` = this rank's patches under frame sharding), and the tensors
  outside the blocks; a test compares it with a real forward's saved tensors (one process and
  CP 2 at world 4). Under pipeline parallelism the first stage checkpoints the tower WHOLE
  (:mod:`qwen35_trainer.model.pipeline.stages`): each micro-batch in flight keeps its pixels only, and
  the blocks' inputs are held once, while one micro-batch's backward recomputes the tower
  (counted in ``backward``; a test compares stage 0's forward with a real one at PP 2).
  Without checkpointing: every block's working set below — its norms, its MoE (counted from the
  saved tensors of the torch expert path; a test compares them with a real forward's at fp32
  and bf16) and its mixer's projections. Not counted: the Gated DeltaNet kernel's own per-chunk
  tensors, which depend on the kernel (the CPU's chunked rule keeps five 64 × 64 fp32 matrices
  per head and chunk, more than the block's hidden states at the real models' 32–64 heads; fla's
  kernel on GPUs keeps fewer, not measured here);
- ``backward``: what ONE decoder block's backward adds while it runs. Under checkpointing its
  working set, rebuilt: its norms, the mixer's projections, the MoE's routed rows (``k·S``
  rows, under EP times the ``ROUTING_SKEW`` factor for the busiest EP rank) and the shared
  expert. Without, its saved tensors are already the ``activations`` line, and what it adds is
  the gradients in flight (:func:`backward_transient`: the residual stream's and those through
  the experts' SwiGLU, a few ``S``-row tensors; counting the working set again, as this line
  did, put tiny-512's one-process step at 1.08 of its measured peak, against 1.03);
- ``loss``: the chunked loss's fp32 gradients kept from the forward (``grad_hidden S·H·4`` and,
  when ``lm_head`` trains, ``grad_weight V·H·4``) plus one chunk's working set
  (:func:`loss_chunk_bytes`: chunked-loss's own rule, at most its 256 MiB budget, fewer bytes
  where the row's ``S`` tokens or the vocabulary are small);
- ``fsdp_buffers``: the largest unit unsharded twice (the running and the prefetched unit) —
  what trains in ``b`` (cast for the compute), what is frozen in its storage dtype (gathered
  as stored: a LoRA run's bf16 or FP8 base) — plus its
  unsharded fp32 gradient (of what trains); the root unit (embeddings, ``lm_head``, merger)
  unsharded for the whole step with its fp32 gradients (of what trains). One LoRA process
  is not sharded (:func:`qwen35_trainer.parallel.parallelize`): only the modules it trains in
  full are, under bf16, each cast to a bf16 copy for the compute (``lm_head`` by the loss);
- ``dequantized``: a base held in FP8 (:mod:`qwen35_trainer.model.fp8.hold`) is dequantized one
  weight at a time as it runs: the largest such weight on this rank (a layer's local experts'
  ``gate_up_proj``) in ``b``, plus its decode's temporaries (:func:`moe_parallel.dequantize`):
  the tables of its blocks' 256 values, built in fp32 then kept in ``b``, and afterwards one
  slice's int32 byte indices of at most :data:`moe_parallel.fp8.CHUNK_ELEMENTS` elements;
- ``pp_grads`` (pipeline parallelism under FSDP): torch's pipeline stages turn FSDP's gradient
  sync off for every micro-batch but the last, so each unit's gradients stay unsharded and
  accumulate in fp32 from the first backward to the step's reduce-scatter: every trained
  parameter of the stage unsharded (the experts split over EP), 4 bytes each; the
  ``fsdp_buffers`` line then holds no gradient of its own (a test measures it at PP 2 × DP 2),
  and the sharded ``gradients``, made by that reduce-scatter once the activations are freed,
  are held at the peak only where they exceed the step's working tensors
  (:attr:`Memory.peak`);
- ``cp_buffers``: full attention's K/V of the whole row gathered over CP (``L_full · T ·
  2·kv·hd · b`` for one layer at a time) and the Gated DeltaNet's passed state (fp32);
- ``vision``: the merged image features of the whole row gathered over CP (``T_img · H · b``);
- ``freed_for_grads`` (≤ 0): the backward frees each decoder layer's saved tensors as it makes
  that layer's gradients (the optimizer zeroes them to ``None`` each step, so none exist
  before). With one micro-batch per step and no PP, the decoder's gradients rise from none to
  all of ``G_dec`` while its activations ``A_dec`` fall to none, the rest of both held
  throughout; and the unit in its backward holds its gradient unsharded (``U``, in
  ``fsdp_buffers``) while its shard ``g`` (in ``G_dec``) is made only after. The peak holds
  ``max(A_dec, G_dec − g + U)`` of the three, not their sum: this line is ``−min(G_dec + U,
  A_dec + g)``. Under PP, on a rank whose every forward runs before its first backward
  (:attr:`.stages.StageView.forwards_first`), the first backward trades one micro-batch's
  activations for the stage's ``pp_grads`` in the same way: ``−min(A_mb, pp_grads)``. With
  more micro-batches (or a later forward) the earlier ones' gradients are held through the
  later ones' forwards: 0, the lines add up;
- the multi-token-prediction head (``D`` depths, :mod:`qwen35_trainer.model.mtp`): its
  parameters, gradients and optimizer state are counted with the rest (exact); per depth its
  layer is one more full-attention block (its input ``S·H·b`` saved under checkpointing, its
  working set without), and outside it the concatenated ``fc`` input ``2·S·H·b`` and the three
  RMSNorms' fp32 inputs and outputs (``6·S·H·4``) are saved (:func:`mtp_saved`); its
  chunked loss recomputes its logits in the backward, so it keeps no gradient from the forward
  (its working chunk is the ``loss`` line's one chunk).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from qwen35_trainer.model.lora.adapters import is_adapter
from qwen35_trainer.model.params import named_parameters
from qwen35_trainer.model.weights.shards import local_index
from qwen35_trainer.plan.activations import (
    Shape,
    backward_transient,
    block_working_set,
    mtp_saved,
    saved_with_checkpointing,
    tower_saved,
)
from qwen35_trainer.plan.stages import StageView

__all__ = ["ROUTING_SKEW", "Memory", "Shape", "loss_chunk_bytes", "memory", "parameter_bytes"]

DECODER_PREFIX = "model.language_model.layers."  # the decoder layers' parameter names
# Assumed tokens on the busiest EP rank over the mean (routing is not balanced exactly).
ROUTING_SKEW = 1.5
_BYTE_VALUES = 256  # the entries of one FP8 block's decode table: a value per byte


@dataclasses.dataclass(frozen=True)
class Memory:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    backward: int
    loss: int
    fsdp_buffers: int
    cp_buffers: int
    vision: int
    dequantized: int = 0
    pp_grads: int = 0
    freed_for_grads: int = 0  # <= 0: the backward's trade of activations for gradients

    @property
    def peak(self) -> int:
        """Every line's bytes held at once (``freed_for_grads`` taking off what the backward
        frees before the gradients take its place); under PP (``pp_grads``) the sharded
        ``gradients`` appear only at the step's final reduce-scatter, after the activations
        are freed, so the peak holds the larger of them and the step's working tensors."""
        total = sum(dataclasses.astuple(self))
        if not self.pp_grads:
            return total
        held = self.parameters + self.optimizer + self.pp_grads
        return held + max(total - held - self.gradients, self.gradients)


def loss_chunk_bytes(text, shape: Shape) -> int:
    """The chunked loss's working set on a rank whose row holds ``S`` tokens: one chunk of
    them (:func:`chunked_loss.linear_chunk_bytes`; ``lm_head`` stays whole under TP, so the
    whole vocabulary)."""
    from chunked_loss import linear_chunk_bytes

    dtype = torch.bfloat16 if shape.compute_bytes == 2 else torch.float32
    return linear_chunk_bytes(shape.tokens, text.vocab_size, text.hidden_size, dtype)


def _local_numel(param: torch.Tensor) -> int:
    return math.prod(len(r) for r in local_index(param))


def parameter_bytes(model: nn.Module, *, trained: bool = False) -> int:
    """This rank's parameter shards (``trained``: those that train), in bytes of their storage
    dtype."""
    return sum(
        _local_numel(p) * p.dtype.itemsize
        for _, _, _, p in named_parameters(model)
        if p.requires_grad or not trained
    )


def _unit_numel(unit: nn.Module, ep: int, *, trained: bool = False) -> int:
    """A unit's elements unsharded by FSDP (experts stay split over EP; ``trained``: only what
    trains)."""
    return sum(
        math.prod(p.shape) // (ep if "experts." in name else 1)
        for name, p in unit.named_parameters()
        if p.requires_grad or not trained
    )


def _gathered(param: torch.Tensor, b: int) -> int:
    """Bytes per element FSDP gathers ``param`` in: ``b`` for what trains (cast for the
    compute), the storage dtype's for what is frozen (gathered as stored)."""
    return b if param.requires_grad else param.dtype.itemsize


def _unit_bytes(unit: nn.Module, ep: int, b: int) -> int:
    """A unit's bytes unsharded by FSDP (:func:`_gathered`; experts stay split over EP)."""
    return sum(
        math.prod(p.shape) // (ep if "experts." in name else 1) * _gathered(p, b)
        for name, p in unit.named_parameters()
    )


def _dequantized(model: nn.Module, b: int) -> int:
    """The most any one FP8 weight of this rank takes dequantized in ``b`` bytes with its
    decode's temporaries (module docstring); 0 without an FP8 base."""
    from moe_parallel.fp8 import CHUNK_ELEMENTS

    most = 0
    for _, module, attr, param in named_parameters(model):
        if param.dtype.itemsize != 1:
            continue
        numel = _local_numel(param)
        tables = _local_numel(getattr(module, f"{attr}_scale_inv")) * _BYTE_VALUES
        temporaries = max(tables * (4 + b), tables * b + min(numel, CHUNK_ELEMENTS) * 4)
        most = max(most, numel * b + temporaries)
    return most


def memory(
    model: nn.Module,
    dims,
    shape: Shape,
    *,
    checkpointing: bool,
    units,
    sharded: bool = True,
    stage: StageView | None = None,
    microbatches: int = 1,
) -> Memory:
    """This rank's :class:`Memory` (module docstring); ``units``: the FSDP unit modules;
    ``sharded``: FSDP wraps the model at all; ``stage``: under pipeline parallelism, this
    rank's layers, whether it holds the first / last stage, and the micro-batches whose
    activations it holds at its peak (:mod:`qwen35_trainer.plan.stages`): the saved
    activations are its layers' (the tower's on the first stage, the final norm's, the MTP
    head's and the loss's on the last) times those micro-batches; ``microbatches``: per step
    (one: the backward trades activations for gradients, ``freed_for_grads``)."""
    text, vision = model.config.text_config, model.config.vision_config
    # under PP with checkpointing the first stage checkpoints the tower whole
    # (qwen35_trainer.model.pipeline.stages): its blocks' inputs are kept for one micro-batch, in the
    # backward, not for each in flight
    pipelined = stage is not None
    whole_tower = pipelined and checkpointing and stage.first
    stage = stage or StageView(tuple(text.layer_types), True, True, 1.0, 0, 0)
    b, s = shape.compute_bytes, shape.tokens
    params = parameter_bytes(model)
    trained = parameter_bytes(model, trained=True)
    fp32_trained = sum(
        _local_numel(p) * 4 for _, _, _, p in named_parameters(model) if p.requires_grad
    )
    tensors = sum(1 for _, _, _, p in named_parameters(model) if p.requires_grad)
    h = text.hidden_size
    full_layers = sum(t == "full_attention" for t in text.layer_types)
    vh = vision.hidden_size
    if checkpointing:
        saved = saved_with_checkpointing(text, vision, shape, stage, whole_tower=whole_tower)
        decoder = len(stage.layer_types) * (s // shape.sequence_split) * h * b  # block inputs
    else:
        decoder = sum(
            block_working_set(text, s // shape.sequence_split, 1.0, b, t == "full_attention")
            for t in stage.layer_types
        )
        tower = vision.depth * shape.patches * (6 * vh + 2 * vision.intermediate_size) * b
        saved = decoder + tower * stage.first
    saved += mtp_saved(text, shape, checkpointing=checkpointing) * stage.last
    one_micro_batch = saved  # the trade's activations under PP (one micro-batch's)
    saved = int(saved * stage.in_flight)
    skew = ROUTING_SKEW if dims.ep > 1 else 1.0  # one EP rank holds every routed row: no skew
    if checkpointing:
        backward = max(block_working_set(text, s, skew, b, full) for full in (False, True))
    else:
        backward = backward_transient(text, s, skew, b)
    if whole_tower:  # the tower's recompute (after the decoder layers' backward)
        backward = max(backward, tower_saved(vision, shape)[1])
    loss = 0
    if stage.last:
        head_trains = model.lm_head.weight.requires_grad  # a LoRA run's lm_head is frozen
        loss = s * h * 4 + text.vocab_size * h * 4 * head_trains + loss_chunk_bytes(text, shape)
    fsdp, pp_grads, unit_grad, unit_shard = _fsdp_lines(
        model, units, dims.ep, b, sharded, pipelined
    )
    if not pipelined and microbatches == 1:
        # the decoder's activations fall as its gradients rise; the unit in its backward holds its
        # gradient unsharded (fsdp_buffers), its shard made after (module docstring)
        trade = min(_decoder_gradients(model) + unit_grad, decoder + unit_shard)
    elif pipelined and stage.forwards_first:
        trade = min(int(one_micro_batch), pp_grads)
    else:
        trade = 0
    cp = 0
    if dims.cp > 1:
        kv = 2 * text.num_key_value_heads * text.head_dim * b
        state = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim
        cp = (shape.row_tokens * kv if full_layers else 0) + 2 * state * 4
    gathered = shape.image_tokens * h * b if dims.cp > 1 and stage.first else 0
    return Memory(
        params,
        trained,
        2 * fp32_trained + 4 * tensors,
        saved,
        backward,
        loss,
        fsdp,
        cp,
        gathered,
        _dequantized(model, b),
        pp_grads,
        -trade,
    )


def _decoder_gradients(model: nn.Module) -> int:
    """Bytes of the decoder layers' gradients on this rank (the trained shards' storage)."""
    return sum(
        _local_numel(p) * p.dtype.itemsize
        for name, _, _, p in named_parameters(model)
        if p.requires_grad and name.startswith(DECODER_PREFIX)
    )


def _fsdp_lines(
    model: nn.Module, units, ep: int, b: int, sharded: bool, pipelined: bool
) -> tuple[int, int, int, int]:
    """``(fsdp_buffers, pp_grads, unit_grad, unit_shard)`` (module docstring): the last two are
    the unsharded fp32 gradient of the unit ``fsdp_buffers`` holds and this rank's shard of it
    (0 where no unit's gradient is held there: PP, or no FSDP)."""
    covered = {id(p) for u in units for p in u.parameters()}
    outside = [p for p in model.parameters() if id(p) not in covered]
    no_sync = pipelined and sharded  # torch's stages reduce-scatter after the last backward only
    pp_grads = unit_grad = unit_shard = 0
    if no_sync:  # each unit stays unsharded after its backward: all of them by the last one
        pp_grads = 4 * (
            sum(_unit_numel(u, ep, trained=True) for u in units)
            + sum(math.prod(p.shape) for p in outside if p.requires_grad)
        )
        unit = sum(_unit_bytes(u, ep, b) for u in units)
    else:
        unit, largest = max(
            ((2 * _unit_bytes(u, ep, b) + _unit_numel(u, ep, trained=True) * 4, u) for u in units),
            default=(0, None),
            key=lambda pair: pair[0],
        )
        if largest is not None and sharded:
            unit_grad = _unit_numel(largest, ep, trained=True) * 4
            unit_shard = sum(_local_numel(p) * 4 for p in largest.parameters() if p.requires_grad)
    root = sum(
        math.prod(p.shape) * (_gathered(p, b) + 4 * p.requires_grad * (not no_sync))
        for p in outside
    )
    fsdp = unit + root
    if not sharded:  # the bf16 compute copies of the modules trained in full
        fsdp = sum(
            _local_numel(p) * b
            for name, _, _, p in named_parameters(model)
            if p.requires_grad and not is_adapter(name) and b < p.dtype.itemsize
        )
    return fsdp, pp_grads, unit_grad, unit_shard
