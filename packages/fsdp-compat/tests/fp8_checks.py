"""A frozen FP8 weight under FSDP2 (a check run in test_fsdp2_dist.py's gloo launches)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _models import dp_cp_mesh

import fsdp_compat
from dist_testkit import assert_close
from fsdp_compat import MixedPrecision, shard_model


def check_frozen_fp8_gathered_as_bytes() -> None:
    """A frozen float8 weight (FP8 bytes + fp32 block scales) beside an fp32 trainable one
    under bf16 mixed precision with ``keep_dtype`` = frozen: FSDP2 all-gathers the FP8 bytes
    and the fp32 scales as stored and the trained weight in bf16 (one uint8 buffer: gloo has no
    float8), and the unit's forward sees the whole weight; without ``keep_dtype`` every
    parameter travels in bf16 (the FP8 bytes as bf16 values: twice the bytes).
    ``full_tensor`` rebuilds the float8 weight bit for bit (as bytes)."""
    torch.manual_seed(0)
    weight = torch.randn(6, 4).to(torch.float8_e4m3fn)
    adapter = torch.randn(3, 4)

    class Frozen8(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
            self.scale = torch.nn.Parameter(torch.full((2, 1), 0.5), requires_grad=False)
            self.adapter = torch.nn.Parameter(adapter.clone())

        def forward(self, x):
            dense = self.weight.float() * self.scale.repeat_interleave(3, 0)
            return (x.float() @ dense.T).sum() + (x @ self.adapter.T).float().sum()

    class Outer(torch.nn.Module):
        _no_split_modules = ("Frozen8",)

        def __init__(self) -> None:
            super().__init__()
            self.unit = Frozen8()

        def forward(self, x):
            return self.unit(x)

    def gathered_bytes(keep):
        precision = MixedPrecision(param_dtype=torch.bfloat16, keep_dtype=keep)
        model = shard_model(Outer(), dp_cp_mesh(), shard_dims=("dp", "cp"),
                            mixed_precision=precision)  # fmt: skip
        sizes = []
        original = dist.all_gather_single

        def recorded(out, inp, *args, **kwargs):
            sizes.append((out.dtype, out.numel()))
            return original(out, inp, *args, **kwargs)

        dist.all_gather_single = recorded
        try:
            x = torch.ones(2, 4)
            out = model(x)
            out.backward()
        finally:
            dist.all_gather_single = original
        return model, x, out, sizes

    world = dist.get_world_size()

    def padded(*params):  # rows padded to the world, times columns and bytes per element
        return sum(-(-rows // world) * world * cols * size for rows, cols, size in params)

    model, x, out, sizes = gathered_bytes(lambda p: not p.requires_grad)
    # the unit gathered for the forward and again for the backward, the same bytes each time
    assert set(sizes) == {(torch.uint8, padded((6, 4, 1), (2, 1, 4), (3, 4, 2)))}, sizes
    want = (x @ (weight.float() * 0.5).T).sum() + (x.bfloat16() @ adapter.bfloat16().T).sum()
    assert_close(out.detach(), want.float())
    assert model.unit.adapter.grad is not None
    full = fsdp_compat.full_tensor(model.unit.weight)
    assert full.dtype == torch.float8_e4m3fn
    assert torch.equal(full.view(torch.uint8), weight.view(torch.uint8))
    _, _, _, cast = gathered_bytes(None)
    assert set(cast) == {(torch.bfloat16, padded((6, 4, 1), (2, 1, 1), (3, 4, 1)))}, cast
