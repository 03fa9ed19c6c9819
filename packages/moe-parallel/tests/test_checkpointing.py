"""Activation checkpointing: same grads, SDPA state restored for recompute, towers chosen right."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends, sdpa_kernel
from torch.utils.checkpoint import CheckpointError, checkpoint
from toy_vlm import VLM, Tower

from dist_testkit import assert_close, assert_grads_close
from moe_parallel import apply_activation_checkpointing


def _grads_of(model, x, seed=5):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("selective", [False, True])
def test_checkpointed_grads_equal_plain(selective):
    torch.manual_seed(0)
    plain = VLM()
    ckpt = copy.deepcopy(plain)
    wrapped = apply_activation_checkpointing(ckpt, selective=selective)
    assert wrapped == [
        "visual.blocks.0",
        "visual.blocks.1",
        "language_model.layers.0",
        "language_model.layers.1",
    ]
    x = torch.randn(2, 6, 16)
    y0, gx0 = _grads_of(plain, x)
    y1, gx1 = _grads_of(ckpt, x)
    assert_close(y1, y0, name="output")
    assert_close(gx1, gx0, name="x.grad")
    assert_grads_close({n: p.grad for n, p in ckpt.named_parameters()}, _renamed(plain, ckpt))


def _renamed(plain, ckpt):
    names = [n for n, _ in ckpt.named_parameters()]
    plain_grads = {n: p.grad for n, p in plain.named_parameters()}
    return {n: plain_grads[n.replace("._checkpoint_wrapped_module", "")] for n in names}


def test_scope_and_frozen_tower():
    model = VLM()
    assert apply_activation_checkpointing(model, scope=("language",)) == [
        "language_model.layers.0",
        "language_model.layers.1",
    ]
    frozen = VLM()
    frozen.visual.requires_grad_(False)
    assert apply_activation_checkpointing(frozen) == [
        "language_model.layers.0",
        "language_model.layers.1",
    ]
    with pytest.raises(ValueError, match="scope"):
        apply_activation_checkpointing(VLM(), scope=("audio",))
    with pytest.raises(ValueError, match="no 'layers'/'blocks' container"):
        apply_activation_checkpointing(nn.Linear(2, 2))


def _scaled_sdpa(q, k, v, **kw):
    """A stand-in for a patched SDPA (what CP does): a different, deterministic function."""
    return 2.0 * torch.nn.attention.__dict__["_orig_sdpa"](q, k, v, **kw)


def test_recompute_uses_forward_sdpa_state():
    torch.nn.attention._orig_sdpa = F.scaled_dot_product_attention
    tower = Tower(2)
    seen: list[list] = []
    orig = F.scaled_dot_product_attention

    def recording(q, k, v, **kw):
        seen.append(list(_cur_sdpa_kernel_backends()))
        return _scaled_sdpa(q, k, v, **kw)

    x = torch.randn(2, 6, 16)

    def run(model, use_ckpt_fn=None):
        torch.manual_seed(1)
        xi = x.clone().requires_grad_()
        F.scaled_dot_product_attention = recording
        try:
            with sdpa_kernel([SDPBackend.MATH]):
                y = use_ckpt_fn(xi) if use_ckpt_fn else model(xi)
        finally:
            F.scaled_dot_product_attention = orig
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
            y.sum().backward()
        return xi.grad

    ref = run(tower)
    ckpt = copy.deepcopy(tower)
    apply_activation_checkpointing(ckpt, scope=("vision", "language"))
    seen.clear()
    got = run(ckpt)
    assert_close(got, ref, name="x.grad under a different ambient SDPA at backward")
    assert len(seen) == 4 and all(s == [SDPBackend.MATH] for s in seen), seen
    # Negative control: plain checkpointing recomputes with the ambient (unpatched) SDPA.
    bare = copy.deepcopy(tower)

    def bare_fn(xi):
        for b in bare.blocks:
            xi = checkpoint(b, xi, use_reentrant=False)
        return xi

    try:
        wrong = run(bare, bare_fn)
    except CheckpointError:  # recompute saw different ops: torch notices, also a failure
        return
    assert not torch.allclose(wrong, ref, atol=1e-4)


def _hf_model():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

    text = dict(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        pad_token_id=0,
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=16,
        num_heads=2,
        patch_size=2,
        out_hidden_size=16,
        num_position_embeddings=16,
    )
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    return transformers.Qwen3_5MoeForConditionalGeneration(cfg)


def test_transformers_qwen35_blocks_found_and_grads_equal():
    plain = _hf_model()
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt) == [
        "model.visual.blocks.0",
        "model.language_model.layers.0",
        "model.language_model.layers.1",
    ]
    frozen = copy.deepcopy(plain)
    frozen.model.visual.requires_grad_(False)
    assert apply_activation_checkpointing(frozen) == [
        "model.language_model.layers.0",
        "model.language_model.layers.1",
    ]
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    for m in (plain, ckpt):
        m.train()
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # a cache mutates in forward
    assert_grads_close(
        {n: p.grad for n, p in ckpt.named_parameters()}, _renamed(plain, ckpt), rtol=1e-4, atol=1e-6
    )


@pytest.mark.parametrize("selective", [False, True])
def test_first_grouped_gemm_probe_inside_a_checkpointed_block(selective):
    """Regression: the one-off grouped-GEMM probe used to run its own backward inside the
    checkpointed block's forward, triggering that block's recompute early (and entering its
    recompute context twice). The probe cache is cleared and the checkpointed model runs first,
    so the probe runs inside a checkpointed MoE block (grouped path: fp32, widths 16 and 8)."""
    from moe_parallel.grouped import _probe

    torch.manual_seed(0)
    plain = VLM()
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, selective=selective)
    x = torch.randn(2, 6, 16)
    _probe.cache_clear()
    y1, gx1 = _grads_of(ckpt, x)
    assert _probe.cache_info().currsize == 1
    y0, gx0 = _grads_of(plain, x)
    assert_close(y1, y0, name="output")
    assert_close(gx1, gx0, name="x.grad")
    assert_grads_close({n: p.grad for n, p in ckpt.named_parameters()}, _renamed(plain, ckpt))


def test_grouped_gemm_probe_is_invisible_to_dispatch_modes_and_saved_tensor_hooks():
    """What selective checkpointing (a dispatch mode) and checkpointing (saved-tensor hooks)
    would see of the probe: nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_parallel.grouped import _probe

    ops, packed = [], []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    _probe.cache_clear()
    with (
        Recorder(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t),
    ):
        assert _probe("cpu", torch.float32)
    assert ops == [] and packed == []


def test_a_block_recomputed_twice_enters_the_restore_context_twice():
    """A graph backpropagated twice (``retain_graph``; a zero-bubble pipeline's inputs pass,
    then its weights pass) recomputes a checkpointed block each time: the recompute context
    (the forward's SDPA backends and callable restored) must enter again, and both passes
    give the plain block's gradients."""
    from moe_parallel import sdpa_preserving_context

    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)

    def block(x):
        q = (x @ w).view(1, 2, 4, 4)
        return F.scaled_dot_product_attention(q, q, q).sum()

    x = torch.randn(4, 8, requires_grad=True)
    plain = torch.autograd.grad(block(x), (x, w))
    out = checkpoint(block, x, use_reentrant=False, context_fn=sdpa_preserving_context)
    inputs = torch.autograd.grad(out, x, retain_graph=True)
    weights = torch.autograd.grad(out, w)
    assert_close(inputs[0], plain[0])
    assert_close(weights[0], plain[1])
