"""A pipeline stage of the Qwen3.5 MoE-VLM: its decoder layers and, on the first stage, the
embedding and the vision tower, on the last the final norm, ``lm_head``, the MTP head and the
loss (:mod:`qwen35_trainer.parallel.pipeline_split` says which layers).

The model keeps its whole module tree on every rank; what another stage holds is replaced by a
parameterless :class:`~qwen35_trainer.model.whole.Elsewhere` (:func:`keep_stages`), so this rank allocates, trains and
checkpoints its own parameters only, under their transformers names: a checkpoint written at
one ``pp`` is read at any other by name.

What travels between stages, per micro-batch (torch's P2P buffers of fixed shapes):

- ``index`` [1, 1] int64: which micro-batch of the step this is. Each stage reads that
  micro-batch's packed row — its document boundaries, M-RoPE positions, labels — from the
  step's inputs (:class:`StepInputs`; every stage rank builds the same micro-batches), so the
  metadata travels with the micro-batch by construction: no stage can pair hidden states with
  another micro-batch's boundaries;
- ``hidden`` [1, T, H]: the residual stream after the stage's layers (this CP rank's ``T`` tokens
  of the row: each CP rank of a stage sends to the same CP rank of the next);
- ``prob_sum`` [E] fp32 and ``counts`` [E + 1] fp32: the router statistics of every MoE layer so
  far (:func:`moe_parallel.router_statistics`, summed; counts carry no gradient). They are sums
  over layers, so the last stage holds the statistics of all layers concatenated and its
  :func:`moe_parallel.balancing_loss_of` is transformers' load-balancing loss over every layer,
  whose gradient reaches each stage's routers back through ``prob_sum``: no stage's aux loss
  is lost or counted twice;
- ``embeds`` [1, S, H] (with the MTP head): the whole row's input embeddings, made by the first
  stage and read by the last (the MTP head's next-token embeddings).

The layers run exactly as transformers' text model runs them (rotary embeddings of the row's
positions, the packed varlen attention kwargs), so the stages compose to the one-process
forward; the last stage's loss is the objective's (:mod:`qwen35_trainer.model.objective`) for
that micro-batch: ``ce + aux_coef * aux / M + mtp_weight * mean(mtp)`` with the step's global
label counts (the aux loss per micro-batch over ``M`` micro-batches, as the step without PP).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cp_varlen_attn import shard_sequence
from moe_parallel import router_statistics
from qwen35_trainer.model.build import moe_blocks
from qwen35_trainer.model.objective import LossShares
from qwen35_trainer.model.pipeline.ends import embed_row, stage_loss
from qwen35_trainer.model.whole import Elsewhere

__all__ = ["StageModule", "StepInputs", "keep_stages"]


def keep_stages(model: nn.Module, stage_layers: list[range], mine: list[int], pp: int) -> None:
    """Replace, in place, every module of ``model`` (on the meta device) that none of the stages
    ``mine`` holds by an :class:`~qwen35_trainer.model.whole.Elsewhere` naming the pipeline rank
    (of ``pp``) that does (module docstring)."""
    text = model.model.language_model
    held = {i for s in mine for i in stage_layers[s]}
    owner = {i: s % pp for s, layers in enumerate(stage_layers) for i in layers}
    first, last = 0, (len(stage_layers) - 1) % pp

    def drop(parent: nn.Module, attr: str, name: str, pp_rank: int) -> None:
        setattr(parent, attr, Elsewhere(name, getattr(parent, attr), pp_rank))

    for i in range(len(text.layers)):
        if i not in held:
            text.layers[i] = Elsewhere(f"model.language_model.layers.{i}", text.layers[i], owner[i])
    if 0 not in mine:
        drop(text, "embed_tokens", "model.language_model.embed_tokens", first)
        drop(model.model, "visual", "model.visual", first)
    if len(stage_layers) - 1 not in mine:
        drop(text, "norm", "model.language_model.norm", last)
        drop(model, "lm_head", "lm_head", last)
        if hasattr(model, "mtp"):
            drop(model, "mtp", "mtp", last)


@dataclasses.dataclass
class StepInputs:
    """One step's micro-batches (``(batch, packed)`` each) and what the loss needs of the whole
    step: the global valid-label count, each MTP depth's, the loss group, ``loss_of(ce,
    aux, mtp)``, the weighted loss (:func:`qwen35_trainer.model.loss.total_loss`), and whether
    the last stage also counts correct predictions (the held-out evaluation)."""

    micro: list
    num_valid: int
    num_mtp: tuple[int, ...]
    loss_of: Callable[..., torch.Tensor]
    loss_group: Any = None
    accuracy: bool = False  # the held-out evaluation: also count the labels predicted right


class StageModule(nn.Module):
    """Stage ``index`` of ``count``: the model's ``layers`` (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        index: int,
        count: int,
        layers: range,
        *,
        loss_chunk_size: Any,
        row_tokens: int,
        split: int = 1,
        tower_checkpoint: bool = False,
        backward_twice: bool = False,
    ) -> None:
        super().__init__()
        # the P2P buffers: ``row_tokens`` per micro-batch's row, this rank's 1/``split`` of them
        self.row_tokens, self.buffer_tokens = row_tokens, row_tokens // split
        self.index, self.first, self.last = index, index == 0, index == count - 1
        text = model.model.language_model
        self.layers = nn.ModuleList(text.layers[i] for i in layers)
        if self.first:
            self.embed_tokens, self.visual = text.embed_tokens, model.model.visual
        if self.last:
            self.norm, self.lm_head = text.norm, model.lm_head
            if hasattr(model, "mtp"):
                self.mtp = model.mtp
        # not registered: the model's tree keeps the names; this stage only runs its parts
        self._model = (model,)
        self.blocks = [moe_blocks(layer) for layer in self.layers]
        self.loss_chunk_size = loss_chunk_size
        self.tower_checkpoint = tower_checkpoint
        # a zero-bubble schedule backpropagates the loss twice (inputs, then weights): the
        # cross-entropy recomputes its chunks' gradients in the backward rather than forming
        # them in the forward (chunked-loss's fused path refuses a second backward)
        self.backward_twice = backward_twice
        self.inputs: StepInputs | None = None
        self.shares: list[LossShares] = []  # the last stage's, per micro-batch (detached)
        self.load: torch.Tensor | None = None  # [layers, E] tokens routed this step (fp32)
        # under sequence parallelism (set by build_pipeline from the objective's router): the
        # TP group whose ranks route one slice each of the tokens, and every rank routing
        # different tokens (the loss group x TP)
        self.sequence_group: Any = None
        self.aux_group: Any = None

    @property
    def model(self) -> nn.Module:
        return self._model[0]

    def forward(self, index_11: torch.Tensor, *received: torch.Tensor):
        batch, packed = self.inputs.micro[int(index_11)]
        rank = dist.get_rank(packed.group) if packed.group is not None else 0
        layout = packed.layout
        tp = 1 if self.sequence_group is None else dist.get_world_size(self.sequence_group)
        if self.first:
            hidden, prob_sum, counts, embeds = embed_row(self, batch, packed, rank)
        else:  # the row's tokens of the buffers (the rest pads them to one shape)
            hidden, prob_sum, counts, *rest = received
            hidden = hidden[:, : layout.local_len(rank) // tp]
            embeds = rest[0][:, : batch.input_ids.shape[1]] if rest else None
        tokens_N = shard_sequence(batch.attention_mask, layout, rank, dim=1).reshape(-1).bool()
        if self.sequence_group is not None:  # this TP rank routes its slice of the tokens
            tokens_N = tokens_N.chunk(tp)[dist.get_rank(self.sequence_group)]
        hidden = self._layers(hidden, packed, rank)
        loads = []
        for block in (b for blocks in self.blocks for b in blocks):
            p, c = router_statistics(block.stats.router_logits[tokens_N], block.top_k)
            prob_sum, counts = prob_sum + p, counts + c
            loads.append(c[:-1])
        load = torch.stack(loads)  # the row's tokens only (a row padded to capacity routes all)
        self.load = load if self.load is None else self.load + load
        if not self.last:
            out = (index_11, _padded(hidden, self.buffer_tokens), prob_sum, counts)
            return out if embeds is None else (*out, _padded(embeds, self.row_tokens))
        return stage_loss(self, batch, packed, rank, hidden, prob_sum, counts, embeds)

    def _layers(self, hidden_BTH: torch.Tensor, packed: Any, rank: int) -> torch.Tensor:
        """This stage's decoder layers, called as transformers' text model calls them."""
        text = self.model.model.language_model
        positions = shard_sequence(packed.position_ids, packed.layout, rank, dim=2)
        text_positions = None
        if positions.shape[0] == 4:
            text_positions, positions = positions[0], positions[1:]
        rope = text.rotary_emb(hidden_BTH, positions)
        for layer in self.layers:
            hidden_BTH = layer(
                hidden_BTH,
                position_embeddings=rope,
                attention_mask=None,
                position_ids=text_positions,
                cache=None,
                use_cache=False,
                cp_layout=packed.layout,
                cp_group=packed.group,
            )
        return hidden_BTH


def _padded(x_BTH: torch.Tensor, tokens: int) -> torch.Tensor:
    """``x_BTH`` with zeros after its tokens up to ``tokens`` (the P2P buffer's shape; a new
    tensor, never a view: FSDP2 refuses a module output that is one). The next stage drops
    them, so no layer computes them and their gradient is zero."""
    return torch.nn.functional.pad(x_BTH, (0, 0, 0, tokens - x_BTH.shape[1]))
