"""The bytes per token the planner's activation lines count (:mod:`.memory`'s docstring states
what each stands for; the tests compare them with a real forward's saved tensors): a decoder
block's norms, mixer and MoE, its working set in the backward with and without checkpointing,
the vision tower's and the multi-token-prediction head's, and the :class:`Shape` they are
counted at. ``b`` = compute bytes, ``S`` = tokens on this rank."""

from __future__ import annotations

import dataclasses

from qwen35_trainer.plan.stages import StageView

__all__ = [
    "Shape",
    "backward_transient",
    "block_working_set",
    "moe_saved",
    "mtp_saved",
    "norms_saved",
    "saved_with_checkpointing",
    "tower_saved",
]


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


def norms_saved(h: int, b: int) -> int:
    """Bytes per token a block's two RMSNorms keep: each its input and its normalised output in
    fp32 (it computes in fp32 whatever the compute dtype), and the projections after it their
    input, its output, in ``b``: ``2·(8·H + H·b)``."""
    return 2 * (8 * h + h * b)


def moe_saved(text, ep_rows: float, b: int) -> float:
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


def block_working_set(text, s: int, ep_rows: float, b: int, full: bool) -> int:
    """Bytes one decoder block keeps while its backward runs (no checkpointing inside): its
    norms (:func:`norms_saved`), its mixer's projections and its MoE (:func:`moe_saved`).
    The Gated DeltaNet's kernel's own per-chunk tensors are not counted (:mod:`.memory`)."""
    h = text.hidden_size
    if full:
        q = text.num_attention_heads * text.head_dim
        kv = text.num_key_value_heads * text.head_dim
        mixer = (2 * q + 2 * kv + 2 * q) * b + 4 * text.num_attention_heads
    else:
        qk = text.linear_num_key_heads * text.linear_key_head_dim
        v = text.linear_num_value_heads * text.linear_value_head_dim
        mixer = (2 * (2 * qk + v) + 3 * v) * b + 4 * v
    return int(s * (mixer + norms_saved(h, b) + moe_saved(text, ep_rows, b)))


def backward_transient(text, s: int, ep_rows: float, b: int) -> int:
    """Bytes a decoder block's backward makes and frees again when nothing is recomputed (its
    saved tensors are the activations line already): the residual stream's gradient into and
    out of the block (``2·S·H·b``) and the gradients through the routed experts' SwiGLU, its
    widest op, alive together: the expert output's (``I``, into the down projection), the
    gate-up output's (``2·I``) and the input rows' (``H``), for ``k·S`` rows times ``ep_rows``
    on the busiest EP rank: ``k·S·(3·I + H)·b``."""
    h, i, k = text.hidden_size, text.moe_intermediate_size, text.num_experts_per_tok
    return int(2 * s * h * b + ep_rows * k * s * (3 * i + h) * b)


def tower_saved(vision, shape: Shape) -> tuple[int, int]:
    """``(pixels, blocks)``: the bytes the checkpointed vision tower saves — its input pixels,
    and each block's input with the merger's saved tensors (:mod:`.memory`'s list)."""
    b, p, vh = shape.compute_bytes, shape.patches, vision.hidden_size
    pixels = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return p * pixels * b, vision.depth * p * vh * b + p * 32 + 4 * p * vh * b


def saved_with_checkpointing(
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
    pixels, blocks = tower_saved(vision, shape)
    tower = pixels + (0 if whole_tower else blocks)
    return decoder + router + tower * stage.first


def mtp_saved(text, shape: Shape, *, checkpointing: bool) -> int:
    """Bytes the MTP head's forward saves for the backward (:mod:`.memory`), all depths."""
    depth = getattr(text, "mtp_num_hidden_layers", 0)
    b, s, h = shape.compute_bytes, shape.tokens, text.hidden_size
    s_layer = s // shape.sequence_split
    layer = s_layer * h * b if checkpointing else block_working_set(text, s_layer, 1.0, b, True)
    return depth * (layer + 2 * s * h * b + 6 * s * h * 4)
