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
  (:func:`_saved_with_checkpointing`): each decoder block's input ``S·H·b``, each vision
  block's ``P·Hv·b`` (``P`` = this rank's patches under frame sharding), and the tensors
  outside the blocks; a test compares it with a real forward's saved tensors (one process and
  CP 2 at world 4). Under pipeline parallelism the first stage checkpoints the tower WHOLE
  (:mod:`qwen35_trainer.model.pipeline.stages`): each micro-batch in flight keeps its pixels only, and
  the blocks' inputs are held once, while one micro-batch's backward recomputes the tower
  (counted in ``recompute``; a test compares stage 0's forward with a real one at PP 2).
  Without checkpointing: every block's working set below — its norms, its MoE (counted from the
  saved tensors of the torch expert path; a test compares them with a real forward's at fp32
  and bf16) and its mixer's projections. Not counted: the Gated DeltaNet kernel's own per-chunk
  tensors, which depend on the kernel (the CPU's chunked rule keeps five 64 × 64 fp32 matrices
  per head and chunk, more than the block's hidden states at the real models' 32–64 heads; fla's
  kernel on GPUs keeps fewer, not measured here);
- ``recompute``: the working set of ONE decoder block rebuilt in the backward: its norms, the
  mixer's projections, the MoE's routed rows (``k·S`` rows, under EP times the
  ``ROUTING_SKEW`` factor for the busiest EP rank) and the shared expert;
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
- ``freed_for_grads`` (≤ 0; one micro-batch per step, no PP): the backward frees each decoder
  layer's saved tensors as it makes that layer's gradients (the optimizer zeroes them to
  ``None`` each step, so none exist before), which rise from none to all of the decoder's
  ``G_dec`` while its activations ``A_dec`` fall to none, the rest of both held throughout: the
  peak holds ``max(A_dec, G_dec)`` of them, not both, and this line is ``−min(A_dec, G_dec)``.
  With more micro-batches the earlier ones' gradients are held through the later ones'
  forwards (the lines add up); under PP, ``pp_grads``' rule;
- the multi-token-prediction head (``D`` depths, :mod:`qwen35_trainer.model.mtp`): its
  parameters, gradients and optimizer state are counted with the rest (exact); per depth its
  layer is one more full-attention block (its input ``S·H·b`` saved under checkpointing, its
  working set without), and outside it the concatenated ``fc`` input ``2·S·H·b`` and the three
  RMSNorms' fp32 inputs and outputs (``6·S·H·4``) are saved (:func:`_mtp_saved`); its
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
from qwen35_trainer.plan.stages import StageView

__all__ = ["ROUTING_SKEW", "Memory", "Shape", "loss_chunk_bytes", "memory", "parameter_bytes"]

DECODER_PREFIX = "model.language_model.layers."  # the decoder layers' parameter names
# Assumed tokens on the busiest EP rank over the mean (routing is not balanced exactly).
ROUTING_SKEW = 1.5
_BYTE_VALUES = 256  # the entries of one FP8 block's decode table: a value per byte


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes the activation formulas need, from the model config and the recipe."""

    tokens: int  # S: tokens of the row(s) on this rank
    row_tokens: int  # T: tokens of one packed row (all CP ranks)
    image_tokens: int  # merged vision tokens of the row
    patches: int  # P: vision patches on this rank
    compute_bytes: int  # b
    sequence_split: int = 1  # tp under sequence parallelism: the SP regions hold S / tp tokens
    grids: tuple = ()  # [t, h, w] of the micro-batch's images and videos (all CP ranks)
    work_grids: tuple = ()  # those a step's time is priced at (a dataset's typical rows)


@dataclasses.dataclass(frozen=True)
class Memory:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    recompute: int
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


def _norms_saved(h: int, b: int) -> int:
    """Bytes per token a block's two RMSNorms keep: each its input and its normalised output in
    fp32 (it computes in fp32 whatever the compute dtype), and the projections after it their
    input, its output, in ``b``: ``2·(8·H + H·b)``."""
    return 2 * (8 * h + h * b)


def _moe_saved(text, ep_rows: float, b: int) -> float:
    """Bytes per token the MoE keeps for its backward (the torch expert path, its saved
    tensors as counted by a real forward's, ``tests/test_plan_memory_probe.py``):

    - routing, in fp32 and int64 whatever ``b``: the router's probabilities and the load
      balancing loss's own (``2·4·E``), the top-k indices of each (``2·8·k``), the renormalised
      weights, their sum and the weights the combine multiplies by (``2·4·k + 4``), the shared
      expert's sigmoid gate (``4``);
    - per routed row (``k`` per token, ``ep_rows`` times the mean on the busiest EP rank): the
      gathered input row, the gate-up output (``2·I``), the SiLU's output and its product with
      up (``I`` each), the expert's output row and its copy in token order, which the weighted
      combine keeps: ``(3·H + 4·I)·b``, and the row's sort order and copy index (``2·8``);
    - the shared expert's gate, up, SiLU and product (``4·I_s``) and its output, which its
      sigmoid gate's product keeps (``H``), in ``b``."""
    h, i, i_s = text.hidden_size, text.moe_intermediate_size, text.shared_expert_intermediate_size
    e, k = text.num_experts, text.num_experts_per_tok
    routing = 8 * e + 16 * k + 8 * k + 8
    routed = ep_rows * k * ((3 * h + 4 * i) * b + 16)
    shared = (4 * i_s + h) * b if i_s else 0
    return routing + routed + shared


def _block_working_set(text, s: int, ep_rows: float, b: int, full: bool) -> int:
    """Bytes one decoder block keeps while its backward runs (no checkpointing inside): its
    norms (:func:`_norms_saved`), its mixer's projections and its MoE (:func:`_moe_saved`).
    The Gated DeltaNet's kernel's own per-chunk tensors are not counted (module docstring)."""
    h = text.hidden_size
    if full:
        q = text.num_attention_heads * text.head_dim
        kv = text.num_key_value_heads * text.head_dim
        mixer = (2 * q + 2 * kv + 2 * q) * b + 4 * text.num_attention_heads
    else:
        qk = text.linear_num_key_heads * text.linear_key_head_dim
        v = text.linear_num_value_heads * text.linear_value_head_dim
        mixer = (2 * (2 * qk + v) + 3 * v) * b + 4 * v
    return int(s * (mixer + _norms_saved(h, b) + _moe_saved(text, ep_rows, b)))


def _tower_saved(vision, shape: Shape) -> tuple[int, int]:
    """``(pixels, blocks)``: the bytes the checkpointed vision tower saves — its input pixels,
    and each block's input with the merger's saved tensors (module docstring's list)."""
    b, p, vh = shape.compute_bytes, shape.patches, vision.hidden_size
    pixels = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return p * pixels * b, vision.depth * p * vh * b + p * 32 + 4 * p * vh * b


def _saved_with_checkpointing(
    text, vision, shape: Shape, stage: StageView, *, whole_tower: bool
) -> int:
    """Bytes saved for the backward at the end of the forward when every decoder and vision
    block is checkpointed (the loss's own fp32 gradients are the ``loss`` line): each block's
    input; the final RMSNorm's fp32 input and normalised output; the router logits of every
    layer kept (fp32) for the aux loss; the vision patch embedding's input pixels and the
    bilinear position-table indices / weights (4 int64 per patch); the merger's LayerNorm input,
    fc1 input, activation input and fc2 input (each ``P·Hv`` elements)."""
    b = shape.compute_bytes
    s = shape.tokens // shape.sequence_split  # the decoder stack's tokens on this rank
    h = text.hidden_size
    layers = len(stage.layer_types)
    decoder = layers * s * h * b + 2 * s * h * 4 * stage.last
    router = layers * s * text.num_experts * 4
    pixels, blocks = _tower_saved(vision, shape)
    tower = pixels + (0 if whole_tower else blocks)
    return decoder + router + tower * stage.first


def _mtp_saved(text, shape: Shape, *, checkpointing: bool) -> int:
    """Bytes the MTP head's forward saves for the backward (module docstring), all depths."""
    depth = getattr(text, "mtp_num_hidden_layers", 0)
    b, s, h = shape.compute_bytes, shape.tokens, text.hidden_size
    s_layer = s // shape.sequence_split
    layer = s_layer * h * b if checkpointing else _block_working_set(text, s_layer, 1.0, b, True)
    return depth * (layer + 2 * s * h * b + 6 * s * h * 4)


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
        saved = _saved_with_checkpointing(text, vision, shape, stage, whole_tower=whole_tower)
        decoder = len(stage.layer_types) * (s // shape.sequence_split) * h * b  # block inputs
    else:
        decoder = sum(
            _block_working_set(text, s // shape.sequence_split, 1.0, b, t == "full_attention")
            for t in stage.layer_types
        )
        tower = vision.depth * shape.patches * (6 * vh + 2 * vision.intermediate_size) * b
        saved = decoder + tower * stage.first
    saved += _mtp_saved(text, shape, checkpointing=checkpointing) * stage.last
    saved = int(saved * stage.in_flight)
    skew = ROUTING_SKEW if dims.ep > 1 else 1.0  # one EP rank holds every routed row: no skew
    recompute = max(_block_working_set(text, s, skew, b, full) for full in (False, True))
    if whole_tower:  # the tower's recompute (after the decoder layers' backward)
        recompute = max(recompute, _tower_saved(vision, shape)[1])
    loss = 0
    if stage.last:
        head_trains = model.lm_head.weight.requires_grad  # a LoRA run's lm_head is frozen
        loss = s * h * 4 + text.vocab_size * h * 4 * head_trains + loss_chunk_bytes(text, shape)
    covered = {id(p) for u in units for p in u.parameters()}
    outside = [p for p in model.parameters() if id(p) not in covered]
    no_sync = pipelined and sharded  # torch's stages reduce-scatter after the last backward only
    pp_grads = 0
    if no_sync:  # each unit stays unsharded after its backward: all of them by the last one
        pp_grads = 4 * (
            sum(_unit_numel(u, dims.ep, trained=True) for u in units)
            + sum(math.prod(p.shape) for p in outside if p.requires_grad)
        )
        unit = sum(_unit_bytes(u, dims.ep, b) for u in units)
    else:
        unit = max(
            (
                2 * _unit_bytes(u, dims.ep, b) + _unit_numel(u, dims.ep, trained=True) * 4
                for u in units
            ),
            default=0,
        )
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
        recompute,
        loss,
        fsdp,
        cp,
        gathered,
        _dequantized(model, b),
        pp_grads,
        -min(decoder, _decoder_gradients(model)) if microbatches == 1 and not pipelined else 0,
    )


def _decoder_gradients(model: nn.Module) -> int:
    """Bytes of the decoder layers' gradients on this rank (the trained shards' storage)."""
    return sum(
        _local_numel(p) * p.dtype.itemsize
        for name, _, _, p in named_parameters(model)
        if p.requires_grad and name.startswith(DECODER_PREFIX)
    )
