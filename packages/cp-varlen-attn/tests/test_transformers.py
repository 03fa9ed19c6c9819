"""The drop-in for transformers (``cp_varlen_attn.transformers``) on a tiny Qwen3.5-MoE VLM: a
packed row of {text, text + image, text + 2-frame video} through ``enable_packing`` equals the
three documents run separately through transformers' own model — logits, loss and every
parameter gradient — with and without the row's attention mask; the unadapted model leaks;
under CP 2 (gloo) each rank's hidden states and the summed gradients equal one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_vlm import IMAGE, VIDEO, documents, tiny_vlm

from cp_varlen_attn import shard_sequence
from dist_testkit import assert_close, run_checks

transformers = pytest.importorskip("transformers")
from cp_varlen_attn.transformers import (  # noqa: E402
    ATTENTION,
    check_transformers,
    enable_packing,
    pack_for_model,
    packed_hidden_states,
)

TOL = {"rtol": 1e-4, "atol": 2e-5}


def _alone(doc):
    """The document as transformers' own batch of one."""
    out = dict(doc)
    ids = torch.as_tensor(doc["input_ids"]).reshape(1, -1)
    out["input_ids"] = ids
    out["mm_token_type_ids"] = (ids == IMAGE).long() + 2 * (ids == VIDEO).long()
    return out


def _separately(model, docs):
    """(logits of each document run alone [sum L, V], their mean next-token CE)."""
    logits, total, count = [], 0.0, 0
    for doc in docs:
        out = model(**_alone(doc), use_cache=False).logits[0]
        ids = torch.as_tensor(doc["input_ids"]).reshape(-1)
        total = total + F.cross_entropy(out[:-1], ids[1:], reduction="sum")
        count += ids.numel() - 1
        logits.append(out)
    return torch.cat(logits), total / count


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mask", ["row mask", "no mask", "all-ones mask"])
def test_packed_row_equals_separate_documents(mask):
    model = tiny_vlm()
    reference = copy.deepcopy(model)
    docs = documents()
    ref_logits, ref_loss = _separately(reference, docs)
    ref_loss.backward()
    assert enable_packing(model) == [
        "model.language_model.layers.0.linear_attn",
        "model.language_model.layers.2.linear_attn",
    ]
    row = pack_for_model(model, docs, pad_to_multiple_of=1 if mask == "all-ones mask" else 8)
    if mask == "no mask":
        del row["attention_mask"]
    out = model(**row)
    n = ref_logits.shape[0]
    assert_close(out.logits[0, :n], ref_logits, **TOL, name="logits")
    assert_close(out.loss, ref_loss, **TOL, name="loss")
    out.loss.backward()
    want, got = _grads(reference), _grads(model)
    assert set(got) == set(want) and any("visual" in k for k in got)
    for name, g in want.items():
        assert_close(got[name], g, **TOL, name=f"grad {name}")


def test_without_the_adaptation_documents_leak():
    model = tiny_vlm()
    docs = documents()
    ref_logits, _ = _separately(model, docs)
    row = pack_for_model(model, docs)  # per-document positions; plain transformers layers
    del row["cp_layout"]
    leaked = model(**row).logits[0, : ref_logits.shape[0]]
    assert (leaked - ref_logits).abs().max() > 1e-2


def test_the_vision_tower_keeps_its_attention_and_masks_are_checked():
    model = tiny_vlm()
    enable_packing(model)
    assert model.config.text_config._attn_implementation == ATTENTION
    assert model.config.vision_config._attn_implementation != ATTENTION
    row = pack_for_model(model, documents(), pad_to_multiple_of=8)
    row["attention_mask"][0, 3] = 0  # inside document 0
    with pytest.raises(ValueError, match="zeroes part of document 0"):
        model(**row)
    with pytest.raises(ValueError, match="call it with the inputs of pack_for_model"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long), use_cache=False)
    with pytest.raises(ValueError, match=r"unknown keys \['pixels'\]"):
        pack_for_model(model, [{"input_ids": torch.ones(3, dtype=torch.long), "pixels": 1}])
    with pytest.raises(ValueError, match="attention_mask has zeros"):
        pack_for_model(
            model, [{"input_ids": torch.ones(3), "attention_mask": torch.tensor([1, 1, 0])}]
        )


def test_a_changed_internal_is_named_with_the_version(monkeypatch):
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    monkeypatch.delattr(hf, "Qwen3_5MoeGatedDeltaNet")
    with pytest.raises(
        ImportError, match=f"transformers {transformers.__version__} changed"
    ) as err:
        check_transformers()
    assert "Qwen3_5MoeGatedDeltaNet" in str(err.value)


def check_cp_equals_one_process():
    rank, world = dist.get_rank(), dist.get_world_size()
    docs = documents()
    one = tiny_vlm()
    enable_packing(one)
    row1 = pack_for_model(one, docs, pad_to_multiple_of=8)
    hidden1, labels1, _ = packed_hidden_states(one, row1)
    logits1 = one.lm_head(hidden1)[0]
    F.cross_entropy(logits1, labels1[0], ignore_index=-100).backward()

    model = tiny_vlm()
    enable_packing(model)
    row = pack_for_model(model, docs, cp_size=world, pad_to_multiple_of=8)
    layout = row["cp_layout"]
    assert any(
        len(p) < layout.cu_seqlens[p.doc + 1] - layout.cu_seqlens[p.doc]
        for pcs in layout.pieces
        for p in pcs
    )  # fmt: skip  (a document is split)
    hidden, labels, _ = packed_hidden_states(model, row, dist.group.WORLD)
    assert_close(hidden, shard_sequence(hidden1, layout, rank), **TOL, name="hidden states")
    count = torch.tensor([(labels != -100).sum()])
    dist.all_reduce(count)
    loss = F.cross_entropy(model.lm_head(hidden)[0], labels[0], ignore_index=-100, reduction="sum")
    (loss / count).backward()
    for name, p in model.named_parameters():
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad)
        want = dict(one.named_parameters())[name].grad
        assert_close(
            grad, torch.zeros_like(grad) if want is None else want, **TOL, name=f"grad {name}"
        )


@pytest.fixture(scope="module")
def cp_report():
    return run_checks([check_cp_equals_one_process], 2, timeout=180)


def test_cp2_equals_one_process(cp_report):
    cp_report.assert_passed(check_cp_equals_one_process)
