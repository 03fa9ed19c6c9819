"""The FA2 indexed-mask shim on a tiny real transformers Qwen3.5 model: the packed forward
equals the per-document forwards. On CPU the FlashAttention kernel is replaced (test-only) by a
per-sequence SDPA over the cu_seqlens transformers hands it, so everything transformers does
with the mask — and what the shim changes — runs for real; the GPU test uses flash-attn."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers.models.qwen3_5_moe", reason="needs transformers >= 5.2")
from transformers import masking_utils
from transformers import modeling_flash_attention_utils as fa_utils
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel

from cp_varlen_attn import (
    PackedBatch,
    indexed_mask_from_doc_ids,
    preserve_indexed_mask_for_flash_attention,
    unpad_data_from_indexed_mask,
)
from dist_testkit import assert_close

DOCS = [torch.tensor([5, 9, 3, 7, 2]), torch.tensor([11]), torch.tensor([4, 4, 8, 30, 12, 6, 1])]


def _model() -> Qwen3_5MoeTextModel:
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, layer_types=["full_attention"] * 2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3_5MoeTextModel(cfg).eval()


def _cpu_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    **_,
):
    """flash_attn_varlen_func's contract on CPU: each cu_seqlens segment attends to itself."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k)
    outs = []
    for s, e in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), strict=True):
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
            is_causal=causal, scale=softmax_scale, enable_gqa=True,
        )  # fmt: skip
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.fixture
def cpu_flash(monkeypatch):
    """Route transformers' FlashAttention-2 calls to the CPU varlen stand-in (this test only)."""
    process = fa_utils._lazy_define_process_function(_cpu_varlen)

    def lazy_import(implementation, *args, **kwargs):
        return (None, _cpu_varlen, None, fa_utils._pad_input, fa_utils._unpad_input), (
            process,
            dict,
        )

    monkeypatch.setattr(fa_utils, "lazy_import_flash_attention", lazy_import)
    monkeypatch.setattr(
        masking_utils, "_preprocess_mask_arguments", masking_utils._preprocess_mask_arguments
    )
    monkeypatch.setattr(fa_utils, "_get_unpad_data", fa_utils._get_unpad_data)


def _per_document(model):
    with torch.no_grad():
        return torch.cat([model(input_ids=d[None]).last_hidden_state[0] for d in DOCS])


def _packed_fa2(model):
    batch = PackedBatch.from_documents(DOCS, 16)
    model.config._attn_implementation = "flash_attention_2"
    mask = indexed_mask_from_doc_ids(batch.doc_ids)[None]
    with torch.no_grad():
        out = model(
            input_ids=batch.input_ids[None],
            attention_mask=mask,
            position_ids=batch.position_ids[None],
        )
    return out.last_hidden_state[0][batch.doc_ids != 0]


def test_packed_fa2_equals_per_document_with_the_shim(cpu_flash):
    model = _model()
    reference = _per_document(model)
    preserve_indexed_mask_for_flash_attention()
    preserve_indexed_mask_for_flash_attention()  # idempotent
    assert_close(_packed_fa2(model), reference, rtol=1e-5, atol=1e-5)


def test_without_the_shim_documents_leak(cpu_flash):
    model = _model()
    reference = _per_document(model)
    leaked = _packed_fa2(model)
    first = DOCS[0].numel()
    assert_close(
        leaked[:first], reference[:first], rtol=1e-5, atol=1e-5
    )  # the first document sees nothing before it
    assert (leaked[first:] - reference[first:]).abs().max() > 1e-3


def test_other_implementations_untouched(cpu_flash):
    preserve_indexed_mask_for_flash_attention()
    model = _model()
    mask = torch.tensor([[1, 1, 2, 2, 0]])
    embeds = torch.zeros(1, 5, 32)
    got = masking_utils.create_causal_mask(model.config, embeds, mask, None)  # sdpa config
    assert got.dtype == torch.bool and got.shape == (
        1,
        1,
        5,
        5,
    )  # built from the bool mask as before


def test_unpad_data_from_indexed_mask():
    mask = torch.tensor([[1, 1, 2, 0, 3, 3], [1, 2, 2, 2, 0, 0]])
    indices, cu, max_len = unpad_data_from_indexed_mask(mask)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert cu.tolist() == [0, 2, 3, 5, 6, 9]
    assert cu.dtype == torch.int32
    assert max_len == 3


def test_fails_loudly_when_internals_change(monkeypatch):
    monkeypatch.delattr(fa_utils, "_get_unpad_data")
    with pytest.raises(
        RuntimeError, match=r"transformers .* changed the internals.*_get_unpad_data"
    ):
        preserve_indexed_mask_for_flash_attention()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_flash_attention_2():
    pytest.importorskip("flash_attn", reason="needs flash-attn (cp-varlen-attn[flash-attn])")
    model = _model().to("cuda", torch.bfloat16)
    reference = torch.cat([model(input_ids=d[None].cuda()).last_hidden_state[0] for d in DOCS])
    preserve_indexed_mask_for_flash_attention()
    batch = PackedBatch.from_documents(DOCS, 16)
    model.config._attn_implementation = "flash_attention_2"
    mask = indexed_mask_from_doc_ids(batch.doc_ids)[None].cuda()
    out = model(
        input_ids=batch.input_ids[None].cuda(),
        attention_mask=mask,
        position_ids=batch.position_ids[None].cuda(),
    )
    torch.testing.assert_close(
        out.last_hidden_state[0][batch.doc_ids.cuda() != 0], reference, rtol=3e-2, atol=3e-2
    )
