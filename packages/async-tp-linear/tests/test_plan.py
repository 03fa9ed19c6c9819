"""swap_tp_linears: the plan's Linears become TPLinear with the same parameters and outputs."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from async_tp_linear import TPLinear, swap_tp_linears
from dist_testkit import assert_close


class Block(nn.Module):
    def __init__(self, bias_down=True):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 12, bias=False)
        self.down = nn.Linear(12, 8, bias=bias_down)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([Block(), Block(bias_down=False)])
        self.head = nn.Linear(8, 10)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _plan():
    return {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "blocks.*.norm": SequenceParallel(),
        "blocks.*": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),)
        ),
        "blocks.*.up": ColwiseParallel(input_layouts=Shard(1)),
        "blocks.*.down": RowwiseParallel(output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1)),
    }


def test_swaps_exactly_the_plan_linears_keeping_parameters_and_outputs():
    torch.manual_seed(0)
    model = Model()
    ids = torch.randint(0, 10, (2, 5))
    expected = model(ids)
    params_before = dict(model.named_parameters())

    swapped = swap_tp_linears(model, _plan())

    assert swapped == ["blocks.0.up", "blocks.1.up", "blocks.0.down", "blocks.1.down", "head"]
    for name in swapped:
        assert type(model.get_submodule(name)) is TPLinear, name
    assert type(model.emb) is nn.Embedding and type(model.blocks[0].norm) is nn.LayerNorm
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[k] is params_before[k] for k in params_before)
    # Only a row-parallel Linear WITH a bias defers its bias past the reduce-scatter.
    assert model.blocks[0].down.reduce_output_to == (Shard(1),)
    assert model.blocks[1].down.reduce_output_to is None
    assert model.blocks[0].up.reduce_output_to is None and model.head.reduce_output_to is None
    # Same function; the deferred bias may round differently from a fused addmm.
    assert_close(model(ids), expected, rtol=1e-6, atol=1e-6, name="logits")
    # Idempotent: a second swap changes nothing.
    assert swap_tp_linears(model, _plan()) == []


def test_plan_key_matching_no_module_is_an_error():
    with pytest.raises(ValueError, match=r"plan key 'blocks\.\*\.mlp\.up' matches no module"):
        swap_tp_linears(Model(), {"blocks.*.mlp.up": ColwiseParallel()})


def test_linear_style_on_a_non_linear_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"'blocks\.\*\.norm' \(ColwiseParallel\) matches 2 module\(s\) of type \['LayerNorm'\], none of them an nn.Linear \(or nn.Embedding\)",
    ):
        swap_tp_linears(Model(), {"blocks.*.norm": ColwiseParallel()})


def test_linear_subclass_and_hooked_linear_and_root_are_refused():
    model = Model()
    model.head = nn.modules.linear.NonDynamicallyQuantizableLinear(8, 10)
    with pytest.raises(ValueError, match=r"'head' is a NonDynamicallyQuantizableLinear"):
        swap_tp_linears(model, {"head": ColwiseParallel()})
    model = Model()
    model.head.register_forward_hook(lambda m, i, o: o)
    with pytest.raises(ValueError, match=r"'head' already has forward hooks"):
        swap_tp_linears(model, {"head": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"names the root module itself"):
        swap_tp_linears(nn.Linear(2, 2), {"": ColwiseParallel()})


def test_bad_argument_types():
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got dict"):
        swap_tp_linears({}, {})
    with pytest.raises(TypeError, match=r"plan must be a mapping .* got list"):
        swap_tp_linears(Model(), [("head", ColwiseParallel())])
    with pytest.raises(
        TypeError, match=r"plan entries must be str -> ParallelStyle, got 'head' -> str"
    ):
        swap_tp_linears(Model(), {"head": "colwise"})
