"""Shape discovery: the shapes found by structure are the shapes the layers' kernels see."""

from __future__ import annotations

import pytest
import torch
from gdn_models import Block, MambaLike, TinyGDN, naive_gated_delta_rule
from torch import nn

from setup_prewarm import GDNShape, find_gdn_shapes, is_gdn_layer, prewarm
from setup_prewarm.fla_warm import run_gdn_kernel


class Recorder:
    """A gated-delta-rule kernel that records (Hk, Hv, Dk, Dv, dtype) of each call."""

    def __init__(self, inner=naive_gated_delta_rule):
        self.inner, self.seen = inner, []

    def __call__(self, q, k, v, g, beta, *args, **kwargs):
        self.seen.append(GDNShape(q.shape[2], v.shape[2], q.shape[3], v.shape[3], q.dtype))
        return self.inner(q, k, v, g, beta, *args, **kwargs)


def test_shapes_match_what_the_kernel_sees():
    torch.manual_seed(0)
    rec = Recorder()
    model = nn.Sequential(
        Block(TinyGDN(8, 2, 4, 8, 8, rec)),
        Block(TinyGDN(8, 2, 4, 8, 8, rec)),  # same shape: reported once
        Block(TinyGDN(8, 1, 2, 4, 6, rec)),
        Block(TinyGDN(8, 2, 4, 8, 8, rec).to(torch.bfloat16)),  # other dtype: its own shape
        Block(MambaLike()),
    )
    for block in model:
        if isinstance(block.linear_attn, TinyGDN):
            block.linear_attn(torch.randn(1, 5, 8, dtype=block.linear_attn.A_log.dtype))
    assert find_gdn_shapes(model) == list(dict.fromkeys(rec.seen))
    assert len(find_gdn_shapes(model)) == 3


def test_structure_not_class_name():
    assert is_gdn_layer(TinyGDN(8, 2, 4, 8, 8))
    assert not is_gdn_layer(MambaLike())
    assert not is_gdn_layer(nn.Linear(4, 4))
    assert find_gdn_shapes(nn.Sequential(MambaLike(), nn.Linear(8, 8))) == []


def test_missing_size_attributes_are_named():
    layer = TinyGDN(8, 2, 4, 8, 8)
    del layer.head_v_dim
    with pytest.raises(ValueError, match=r"0 \(TinyGDN\).*lacks int attributes \['head_v_dim'\]"):
        find_gdn_shapes(nn.Sequential(layer))


def test_attributes_disagreeing_with_parameters_are_rejected():
    layer = TinyGDN(8, 2, 4, 8, 8)
    layer.head_k_dim = 4
    with pytest.raises(ValueError, match=r"in_proj_qkv has 64 outputs; expected .* = 48"):
        find_gdn_shapes(layer)
    layer = TinyGDN(8, 2, 4, 8, 8)
    layer.num_v_heads = 3
    with pytest.raises(ValueError, match=r"A_log has 4 and dt_bias 4 elements"):
        find_gdn_shapes(layer)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got str"):
        find_gdn_shapes("model")


def test_tp_local_attributes_with_global_parameters():
    """A TP rank (tp=2) holds local head counts; its parameters are global: factor f = 2."""
    layer = TinyGDN(8, 2, 4, 8, 8)
    layer.num_k_heads, layer.num_v_heads = 1, 2
    assert find_gdn_shapes(layer) == [GDNShape(1, 2, 8, 8, torch.float32)]


def test_fla_step_on_cpu_is_skipped_naming_the_shapes():
    report = prewarm(Block(TinyGDN(8, 2, 4, 8, 8)), device="cpu")
    fla = report["fla"]
    assert fla.status == "skipped"
    assert fla.reason == "needs a CUDA device, got cpu (shapes: qk 2x8 v 4x8 float32)"
    assert prewarm(None, device="cpu")["fla"].reason == "no model given"
    assert prewarm(nn.Linear(2, 2), device="cpu")["fla"].reason == (
        "no gated-delta-rule layers in the model"
    )


def test_fla_step_with_a_bad_layer_fails_and_the_rest_runs():
    layer = TinyGDN(8, 2, 4, 8, 8)
    layer.num_k_heads = "two"
    report = prewarm(layer, device="cpu")
    assert report["fla"].status == "failed"
    assert "lacks int attributes ['num_k_heads']" in report["fla"].error
    assert report["cublas"].status == "skipped"
    assert report["comm_groups"].status == "skipped"


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_warm_inputs_follow_the_kernel_contract(packed):
    """The prewarm's kernel call, run with the naive reference kernel: shapes, dtypes,
    a [B, T, Hv, Dv] output, gradients for every input, packed documents kept apart."""
    shape = GDNShape(2, 4, 8, 6, torch.float32)
    rec = Recorder()
    run_gdn_kernel(rec, shape, torch.device("cpu"), packed=packed)
    assert rec.seen == [shape]

    def bad(q, k, v, g, beta, **kw):
        return q, None

    with pytest.raises(RuntimeError, match=r"output is \(.*\), expected"):
        run_gdn_kernel(bad, shape, torch.device("cpu"), packed=packed)

    def no_grad_for_beta(q, k, v, g, beta, **kw):
        out, _ = naive_gated_delta_rule(q, k, v, g, beta.detach(), **kw)
        return out, None

    with pytest.raises(RuntimeError, match=r"no gradient for \['b'\]"):
        run_gdn_kernel(no_grad_for_beta, shape, torch.device("cpu"), packed=packed)


def test_naive_reference_resets_state_at_document_starts():
    """The test kernel itself: with cu_seqlens, the second document equals a fresh run."""
    torch.manual_seed(1)
    q, k = torch.randn(1, 9, 1, 4), torch.randn(1, 9, 1, 4)
    v, g, beta = torch.randn(1, 9, 2, 3), -torch.rand(1, 9, 2), torch.rand(1, 9, 2)
    packed, _ = naive_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))
    alone, _ = naive_gated_delta_rule(q[:, 4:], k[:, 4:], v[:, 4:], g[:, 4:], beta[:, 4:])
    torch.testing.assert_close(packed[:, 4:], alone)
