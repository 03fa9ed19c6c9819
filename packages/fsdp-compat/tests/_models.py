"""Tiny models for the sharding tests and their single-process reference training loop.

Sizes are chosen so that some parameters have fewer elements than the world size (a (1,)
gate, a (3,) scale): on 4 ranks FSDP2 leaves some ranks with empty local shards.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

H, V, S, B, E = 8, 16, 6, 2, 4


def dp_cp_mesh():
    """The launch's ranks as a (dp, cp) mesh with cp = 2."""
    import torch.distributed as dist

    from dist_testkit import make_mesh

    return make_mesh((dist.get_world_size() // 2, 2), ("dp", "cp"))


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP, residual; ``gate`` has a single element."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        # No bias: a key bias has an exactly zero gradient, whose rounding noise Adam would
        # turn into +-lr updates that differ between the sharded and the reference run.
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.proj = nn.Linear(H, H)
        self.mlp_in = nn.Linear(H, 2 * H)
        self.mlp_out = nn.Linear(2 * H, H)
        self.gate = nn.Parameter(torch.full((1,), 0.7))

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x_BSH)).chunk(3, dim=-1)
        att_BSH = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BSH = x_BSH + self.proj(att_BSH)
        return x_BSH + self.gate * self.mlp_out(F.gelu(self.mlp_in(x_BSH)))


class TinyTransformer(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_BSH = self.embed(tokens_BS)
        for block in self.blocks:
            x_BSH = block(x_BSH)
        return self.head(x_BSH * self.scale.mean())


class TPBlock(nn.Module):
    """An MLP to be tensor-parallelised: ``fc1`` colwise, ``fc2`` rowwise."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(H, 4 * H)
        self.fc2 = nn.Linear(4 * H, H)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return x_BSH + self.fc2(F.gelu(self.fc1(x_BSH)))


class TPModel(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["TPBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.block = TPBlock()
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens_BS)))


class Experts(nn.Module):
    """E experts as one 3-D weight; as a DTensor ``Shard(0)`` on an "ep" mesh each EP rank
    holds E/ep experts and the weighted expert sum is a Partial that is all-reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.w_EHH = nn.Parameter(torch.randn(E, H, H) * 0.3)

    def forward(self, x_NH: torch.Tensor, probs_NE: torch.Tensor) -> torch.Tensor:
        w_EHH = self.w_EHH
        if isinstance(w_EHH, DTensor):
            mesh = w_EHH.device_mesh
            x_NH = DTensor.from_local(x_NH, mesh, [Replicate()], run_check=False)
            probs_NE = DTensor.from_local(probs_NE, mesh, [Replicate()], run_check=False)
        y_ENH = torch.einsum("nh,ehk->enk", x_NH, w_EHH)
        y_NH = (y_ENH * probs_NE.transpose(0, 1).unsqueeze(-1)).sum(0)
        if isinstance(y_NH, DTensor):
            # full_tensor() hands back a view of the reduced buffer; a module FSDP2 wraps must
            # not return a view (torch warns; the workspace makes that warning an error)
            return y_NH.full_tensor().clone()
        return y_NH


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E)
        self.experts = Experts()

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_NH = x_BSH.reshape(-1, H)
        probs_NE = self.router(x_NH).softmax(-1)
        return x_BSH + self.experts(x_NH, probs_NE).reshape(x_BSH.shape)


class MoEModel(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["MoEBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.moe = MoEBlock()
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.embed(tokens_BS)))


def batches(n_data: int, steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """``[step][data_rank]`` token batches [B, S+1] (inputs and shifted labels)."""
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, V, (B, S + 1), generator=g) for _ in range(n_data)] for _ in range(steps)
    ]


def lm_loss(model: nn.Module, tokens_BS1: torch.Tensor) -> torch.Tensor:
    logits_BSV = model(tokens_BS1[:, :-1])
    return F.cross_entropy(logits_BSV.reshape(-1, V).float(), tokens_BS1[:, 1:].reshape(-1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)


def reference_run(
    model: nn.Module, data: Sequence[Sequence[torch.Tensor]]
) -> list[tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """One process: per step the loss averaged over the data ranks' batches, its gradients and
    the parameters after the optimizer step."""
    model = copy.deepcopy(model)
    opt = make_optimizer(model)
    out = []
    for step_batches in data:
        opt.zero_grad()
        loss = sum(lm_loss(model, b) for b in step_batches) / len(step_batches)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        out.append(
            (loss.item(), grads, {n: p.detach().clone() for n, p in model.named_parameters()})
        )
    return out
