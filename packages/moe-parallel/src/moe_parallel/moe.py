"""The Qwen3.5 sparse MoE block: top-k router, stacked SwiGLU experts, gated shared expert.

Parameter names and shapes equal transformers' ``Qwen3_5MoeSparseMoeBlock`` (``gate.weight``
[E, H], ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I],
``shared_expert.{gate,up,down}_proj.weight``, ``shared_expert_gate.weight`` [1, H]), and the
math is the same: softmax over all experts in fp32, top-k, renormalise to sum 1, per-assignment
SwiGLU, weighted sum, plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``.

Why it also stays correct under expert parallelism: the experts return the UNWEIGHTED output of
every (token, slot) assignment; the routing weights are applied here, on the token's home rank,
after the experts' rows came back. So the router's gradient is computed locally from
differentiable probabilities and never has to cross a collective, and the experts' gradients
are the same whether a row was computed locally or on another rank.

The load-balancing loss equals transformers' ``load_balancing_loss_func`` applied to this
block's router logits alone (``E * sum_e f_e * P_e`` with ``f_e`` the fraction of top-k
assignments and ``P_e`` the mean probability of expert ``e``). By default it covers the calling
rank's tokens. With ``MoE.aux_loss_group`` set (the ranks holding disjoint tokens of one global
batch: DP x CP, not TP replicas), each rank gets its SHARE of the global-batch loss, see
:func:`load_balancing_loss`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_parallel.fp8 import BlockFormat, FP8Weight
from moe_parallel.grouped import EXPERT_BACKENDS, LoRAFactors, expert_swiglu
from moe_parallel.pieces import assignments_in_pieces, takes_pieces

__all__ = ["ADAPTERS", "MoE", "MoEStats", "load_balancing_loss"]

# the expert adapters' parameters of an Experts module (moe_parallel.lora adds them): A [E, r,
# in], B [E, out, r] per projection
ADAPTERS = ("lora_gate_up_A", "lora_gate_up_B", "lora_down_A", "lora_down_B")


@dataclasses.dataclass
class MoEStats:
    """What one forward of :class:`MoE` routed (kept on ``MoE.stats``).

    Attributes:
        router_logits: [N, E] router logits of the N = B*S tokens (differentiable).
        aux_loss: scalar load-balancing loss of this block (differentiable, not yet scaled by
            ``router_aux_loss_coef``); this rank's share of the global-batch loss when
            ``MoE.aux_loss_group`` is set.
        tokens_per_expert: [E] int64, top-k assignments per expert made by this rank's tokens.
    """

    router_logits: torch.Tensor
    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor


def load_balancing_loss(
    router_logits_NE: torch.Tensor, top_k: int, *, group: Any = None
) -> torch.Tensor:
    """``E * sum_e (assignments_e / N) * (prob_sum_e / N)`` for router logits [N, E] (scalar).

    With ``group`` (a process group whose ranks hold disjoint tokens of one batch), the
    assignment counts and N are summed over the group (one all-reduce of E + 1 numbers, no
    gradient: they are piecewise constant), while ``prob_sum_e`` stays this rank's own. The
    result is this rank's share: the shares sum over the group to the loss of the concatenated
    batch, and since that loss is linear in the per-rank probability sums, the gradient of each
    share w.r.t. this rank's logits equals the global loss's gradient. So summing gradients over
    the group (as data parallelism does) gives the single-process gradient exactly; the sum of
    the shares (all-reduce) is the value to log.
    """
    prob_sum_E, counts_E1 = router_statistics(router_logits_NE, top_k)
    return balancing_loss_of(prob_sum_E, counts_E1, group=group)


def router_statistics(
    router_logits_NE: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prob_sum [E] fp32, differentiable; counts [E + 1] fp32: top-k assignments per expert,
    then N)`` of router logits [N, E]. Both are sums over the rows, so the statistics of
    several pieces of a batch (e.g. layers held by different pipeline stages) ADD to the
    statistics of the pieces concatenated: :func:`balancing_loss_of` their sums equals
    :func:`load_balancing_loss` of the concatenation."""
    num_experts = router_logits_NE.shape[-1]
    probs_NE = torch.softmax(router_logits_NE.float(), dim=-1)
    top_i = torch.topk(probs_NE, top_k, dim=-1).indices
    counts_E1 = torch.cat(
        [
            torch.bincount(top_i.reshape(-1), minlength=num_experts),
            torch.tensor([router_logits_NE.shape[0]], device=top_i.device),
        ]
    ).float()
    return probs_NE.sum(0), counts_E1


def balancing_loss_of(
    prob_sum_E: torch.Tensor, counts_E1: torch.Tensor, *, group: Any = None
) -> torch.Tensor:
    """The load-balancing loss (share, with ``group``) of :func:`router_statistics`' sums:
    ``counts_E1`` is summed over ``group`` (a copy; no gradient), ``prob_sum_E`` stays this
    rank's (see :func:`load_balancing_loss`)."""
    counts_E1 = counts_E1.detach().clone()
    if group is not None:
        dist.all_reduce(counts_E1, group=group)
    rows = counts_E1[-1].clamp(min=1)
    frac_E = counts_E1[:-1] / rows
    return prob_sum_E.shape[0] * torch.sum(frac_E * prob_sum_E / rows)


class TopKRouter(nn.Module):
    """``gate``: logits [N, E] → (logits, renormalised top-k weights [N, K], indices [N, K])."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits_NE = F.linear(x_NH, self.weight)
        probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
        top_w_NK, top_i_NK = torch.topk(probs_NE, self.top_k, dim=-1)
        top_w_NK = top_w_NK / top_w_NK.sum(dim=-1, keepdim=True)
        return logits_NE, top_w_NK.to(logits_NE.dtype), top_i_NK


class Experts(nn.Module):
    """Stacked routed experts; ``forward`` returns the unweighted output of each assignment.

    After :func:`moe_parallel.apply_expert_parallel` the weights are DTensors ``Shard(0)`` over
    the EP mesh and ``ep_group`` is set; rows then travel to their expert's rank and back.
    ``tp_group`` (set by ``apply_expert_parallel(..., tp_mesh=...)``) splits identical tokens
    over TP ranks before the dispatch. ``backend`` is the :func:`moe_parallel.expert_swiglu`
    backend (``"auto"``, ``"torch"`` or ``"te"``). ``lora_spec``: set with the experts'
    low-rank adapters (:func:`moe_parallel.add_expert_lora`), applied inside the grouped
    computation. ``fp8_block``: set when the (frozen) weights are held in block-scaled FP8
    (:func:`moe_parallel.quantize_experts`: ``gate_up_proj`` / ``down_proj`` float8_e4m3fn with
    ``gate_up_proj_scale_inv`` / ``down_proj_scale_inv``), dequantized per call.
    """

    def __init__(
        self, hidden_size: int, num_experts: int, intermediate_size: int, backend: str = "auto"
    ) -> None:
        super().__init__()
        if backend not in EXPERT_BACKENDS:
            raise ValueError(f"expert_backend must be one of {EXPERT_BACKENDS}, got {backend!r}")
        self.num_experts = num_experts
        self.backend = backend
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.lora_spec: Any = None
        self.fp8_block: tuple[int, int] | None = None
        self.ep_group: Any = None
        self.tp_group: Any = None

    def _local_weights(self) -> tuple[Any, Any]:
        """This rank's experts' ``(gate_up, down)``: tensors, or :class:`FP8Weight` when the
        weights are held in FP8."""

        def local(name: str) -> torch.Tensor:
            param = getattr(self, name)
            return param.to_local() if hasattr(param, "to_local") else param

        if self.fp8_block is None:
            return local("gate_up_proj"), local("down_proj")
        return tuple(
            FP8Weight(local(name), local(f"{name}_scale_inv"), BlockFormat(self.fp8_block, parts))
            for name, parts in (("gate_up_proj", 2), ("down_proj", 1))
        )

    def _lora_factors(self) -> LoRAFactors | None:
        """This rank's adapters (dropout only in training), or ``None`` without them."""
        spec = self.lora_spec
        if spec is None:
            return None
        weights = [getattr(self, name) for name in ADAPTERS]
        local = [w.to_local() if hasattr(w, "to_local") else w for w in weights]
        return LoRAFactors(*local, scale=spec.scale, dropout=spec.dropout if self.training else 0.0)

    # Inside a torch.compile-d block the routed experts run eagerly: their row counts are
    # data-dependent (bincount, the dispatch's split sizes), so Dynamo breaks the graph here
    # anyway, and across those breaks it rebuilds the closure's ``to_local()`` expert shards
    # with the DTensor's global shape (an EP rank then sees all E experts: wrong shapes).
    # The grouped GEMM is a library kernel either way.
    @torch.compiler.disable
    def forward(self, x_NH: torch.Tensor, top_i_NK: torch.Tensor) -> torch.Tensor:
        """x_NH [N, H], top_i_NK [N, K] expert ids → [N, K, H] per-assignment outputs.

        With ``tp_group`` set, this TP rank runs only its row block and the blocks are gathered
        (see :mod:`moe_parallel.token_split`).
        """
        if self.tp_group is None:
            return self._forward_rows(x_NH, top_i_NK)
        from moe_parallel.token_split import GatherRows, SliceRows, row_block

        group = self.tp_group
        lo, hi = row_block(x_NH.shape[0], dist.get_rank(group), dist.get_world_size(group))
        y_block = self._forward_rows(SliceRows.apply(x_NH, group), top_i_NK[lo:hi])
        return GatherRows.apply(y_block, x_NH.shape[0], group)

    def _forward_rows(self, x_NH: torch.Tensor, top_i_NK: torch.Tensor) -> torch.Tensor:
        from moe_parallel.dispatch import all_to_all_expert_compute

        n, k = top_i_NK.shape
        flat_i = top_i_NK.reshape(-1)
        order = torch.argsort(flat_i, stable=True)
        counts_E = torch.bincount(flat_i, minlength=self.num_experts)
        gate_up, down = self._local_weights()
        lora = self._lora_factors()
        if self.ep_group is None and takes_pieces(order.numel(), x_NH.device, gate_up, down):
            # on CPU, piece by piece from the tokens to the outputs (moe_parallel.pieces)
            factors = list(lora[:4]) if lora is not None else []

            def piece(rows_MH, local_counts, gate_up, down, *factors):
                adapters = LoRAFactors(*factors, lora.scale, lora.dropout) if factors else None
                return expert_swiglu(
                    rows_MH, local_counts, gate_up, down, backend=self.backend, lora=adapters
                )

            weights = [gate_up, down, *factors]
            return assignments_in_pieces(x_NH, k, order, counts_E, weights, piece)
        # index_select, not x_NH[order // k]: advanced indexing's backward (index_put_ with
        # accumulate) adds a token's k gradient rows with atomics in thread-timing order on a
        # multi-threaded CPU (run-to-run different sums); index_add_ adds them in a fixed order
        x_sorted = x_NH.index_select(0, order // k)

        def compute(rows_MH: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
            return expert_swiglu(
                rows_MH, local_counts, gate_up, down, backend=self.backend, lora=lora
            )

        if self.ep_group is None:
            y_sorted = compute(x_sorted, counts_E)
        else:
            y_sorted = all_to_all_expert_compute(x_sorted, counts_E, compute, self.ep_group)
        # back to assignment order, written into a fresh [N, K, H] tensor: the module's output
        # is not a view (FSDP2 cannot track in-place use of a view a wrapped module returns);
        # index_copy_'s backward is an index_select, so it adds in no order-dependent way
        h = y_sorted.shape[-1]
        y_NKH = y_sorted.new_empty(n, k, h)
        y_NKH.view(n * k, h).index_copy_(0, order, y_sorted)
        return y_NKH


class SwiGLU(nn.Module):
    """The shared expert: ``down(silu(gate(x)) * up(x))`` with bias-free linears."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Dropless Qwen3.5 MoE block. ``forward(x [B, S, H]) -> [B, S, H]``; see :class:`MoEStats`.

    After each forward, ``self.stats`` holds the step's router logits, aux loss and per-expert
    token counts; set ``aux_loss_group`` for the global-batch aux-loss share (see
    :func:`load_balancing_loss`). ``shared_intermediate_size=0`` builds a block without a shared expert.
    ``expert_backend`` picks the routed-expert compute: ``"torch"`` (``torch._grouped_mm`` or an
    exact loop, any device), ``"te"`` (TransformerEngine's ``GroupedLinear``, CUDA) or
    ``"auto"`` (TE on CUDA when it imports, else torch); parameters and state dict are the same.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int = 0,
        *,
        router_aux_loss_coef: float = 0.0,
        init_std: float = 0.02,
        expert_backend: str = "auto",
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size),
            ("num_experts", num_experts),
            ("intermediate_size", intermediate_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.router_aux_loss_coef = router_aux_loss_coef
        self.gate = TopKRouter(hidden_size, num_experts, top_k)
        self.experts = Experts(hidden_size, num_experts, intermediate_size, expert_backend)
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate_size:
            self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.stats: MoEStats | None = None
        self.aux_loss_group: Any = None
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, init_std)

    @classmethod
    def from_config(cls, config: Any, *, expert_backend: str = "auto") -> MoE:
        """Build from a transformers ``Qwen3_5MoeTextConfig`` (or a config with ``text_config``)."""
        config = getattr(config, "text_config", config)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(
                f"MoE implements SwiGLU experts (hidden_act 'silu'), config has {act!r}"
            )
        return cls(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            getattr(config, "shared_expert_intermediate_size", 0) or 0,
            router_aux_loss_coef=getattr(config, "router_aux_loss_coef", 0.0),
            init_std=getattr(config, "initializer_range", 0.02),
            expert_backend=expert_backend,
        )

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        if x_BSH.dim() != 3 or x_BSH.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE expects [B, S, {self.hidden_size}], got {tuple(x_BSH.shape)}")
        x_NH = x_BSH.reshape(-1, self.hidden_size)
        logits_NE, top_w_NK, top_i_NK = self.gate(x_NH)
        y_NKH = self.experts(x_NH, top_i_NK)
        out_NH = (y_NKH * top_w_NK.unsqueeze(-1)).sum(1)
        if self.shared_expert is not None:
            out_NH = out_NH + torch.sigmoid(self.shared_expert_gate(x_NH)) * self.shared_expert(
                x_NH
            )
        self.stats = MoEStats(
            router_logits=logits_NE,
            aux_loss=load_balancing_loss(logits_NE, self.top_k, group=self.aux_loss_group),
            tokens_per_expert=torch.bincount(top_i_NK.reshape(-1), minlength=self.num_experts),
        )
        return out_NH.view_as(x_BSH)
