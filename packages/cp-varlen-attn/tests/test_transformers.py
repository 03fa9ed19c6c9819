"""The drop-in for transformers (``cp_varlen_attn.transformers``) on a tiny Qwen3.5-MoE VLM: a
packed row of {text, text + image, text + 2-frame video} through ``enable_packing`` equals the
three documents run separately through transformers' own model — logits, loss and every
parameter gradient — with and without the row's attention mask; the unadapted model leaks;
under CP 2 (gloo) each rank's hidden states and the summed gradients equal one process.
``mrope_positions`` (config only) equals the model's ``get_rope_index`` on text, images and
videos; ``packed_hidden_states`` runs the vision tower once for images and videos together and
equals transformers' per-document forward."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_vlm import IMAGE, VIDEO, documents, mixed_document, processor_document, tiny_vlm

from cp_varlen_attn import shard_sequence
from dist_testkit import assert_close, run_checks

transformers = pytest.importorskip("transformers")
from cp_varlen_attn.transformers import (  # noqa: E402
    ATTENTION,
    check_transformers,
    embed_packed_row,
    enable_packing,
    mrope_positions,
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


# Grids in units of the merge size: ("image", (t, a, b)) is the grid (t, a·m, b·m).
ROPE_CASES = {
    "text only": [("text", 7)],
    "images": [("text", 3), ("image", (1, 2, 2)), ("text", 2), ("image", (1, 1, 3)),
               ("image", (1, 3, 1)), ("text", 4)],
    "image t=2 and at the ends": [("image", (2, 2, 3)), ("text", 1), ("image", (1, 1, 2))],
    "video t=2": [("text", 2), ("video", (2, 2, 2)), ("text", 3)],
    "video t=3 non-square": [("text", 1), ("video", (3, 1, 2)), ("text", 2)],
    "two videos": [("video", (2, 2, 1)), ("text", 1), ("video", (3, 1, 1))],
    "images and videos": [("image", (1, 2, 2)), ("text", 2), ("video", (2, 2, 1)), ("text", 1),
                          ("image", (1, 1, 2)), ("video", (3, 2, 2)), ("text", 2)],
}  # fmt: skip


@pytest.fixture(scope="module")
def vlm():
    return tiny_vlm()


def _rope_index(model, doc):
    """transformers' positions of one document [3, L]."""
    alone = _alone(doc)
    pos, _ = model.model.get_rope_index(
        alone["input_ids"],
        alone["mm_token_type_ids"],
        image_grid_thw=doc.get("image_grid_thw"),
        video_grid_thw=doc.get("video_grid_thw"),
    )
    return pos[:, 0]


@pytest.mark.parametrize("merge", [2, 3])
@pytest.mark.parametrize("case", ROPE_CASES)
def test_mrope_positions_equal_get_rope_index(vlm, case, merge, monkeypatch):
    monkeypatch.setattr(vlm.config.vision_config, "spatial_merge_size", merge)
    doc = processor_document(ROPE_CASES[case], merge=merge)
    want = _rope_index(vlm, doc)
    got = mrope_positions(vlm.config, doc["input_ids"], doc["mm_token_type_ids"],
                          doc.get("image_grid_thw"), doc.get("video_grid_thw"))  # fmt: skip
    assert got.dtype == torch.long and got.shape == (3, doc["input_ids"].numel())
    assert torch.equal(got, want), f"{case}: {got.tolist()} != {want.tolist()}"
    if case != "text only":  # vision positions are not a plain count
        assert not torch.equal(got, torch.arange(got.shape[1]).expand(3, -1))


def test_mrope_positions_refuse_mismatches(vlm):
    cfg = vlm.config
    doc = processor_document([("text", 2), ("image", (1, 2, 2)), ("text", 1), ("video", (2, 1, 1))])
    ids, mm = doc["input_ids"], doc["mm_token_type_ids"]
    images, videos = doc["image_grid_thw"], doc["video_grid_thw"]
    mrope_positions(cfg, ids, mm, images, videos)  # the document itself is fine
    with pytest.raises(ValueError, match="must be 1-D"):
        mrope_positions(cfg, ids[None], mm[None], images, videos)
    with pytest.raises(
        ValueError, match=f"{ids.numel()} tokens but mm_token_type_ids {ids.numel() - 1}"
    ):
        mrope_positions(cfg, ids, mm[:-1], images, videos)
    with pytest.raises(ValueError, match=r"image run 0 \(4 tokens\) has no grid: 0 image grids"):
        mrope_positions(cfg, ids, mm, None, videos)
    with pytest.raises(ValueError, match="2 image grids came but the document has 1 image runs"):
        mrope_positions(cfg, ids, mm, torch.cat([images, images]), videos)
    with pytest.raises(
        ValueError, match=r"image run 0 has 4 tokens, but .* expects t\*h\*w/m\^2 = 8"
    ):
        mrope_positions(cfg, ids, mm, torch.tensor([[1, 4, 8]]), videos)
    with pytest.raises(ValueError, match="3 video frame grids came but the document has 2"):
        mrope_positions(cfg, ids, mm, images, torch.tensor([[3, 2, 2]]))  # t=3, two frame runs
    with pytest.raises(ValueError, match=r"video frame run 1 \(1 tokens\) has no grid"):
        mrope_positions(cfg, ids, mm, images, torch.tensor([[1, 2, 2]]))
    with pytest.raises(ValueError, match="not multiples of spatial_merge_size 2"):
        mrope_positions(cfg, ids, mm, torch.tensor([[1, 4, 3]]), videos)
    with pytest.raises(ValueError, match=r"holds 3; expected 0 \(text\), 1 \(image\) or 2"):
        mrope_positions(cfg, ids, torch.where(mm == 2, 3, mm), images, None)
    with pytest.raises(TypeError, match=r"no vision_config\.spatial_merge_size"):
        mrope_positions(cfg.text_config, ids, mm, images, videos)


def test_pack_for_model_takes_the_config_and_precomputed_positions(vlm):
    docs = [*documents(), mixed_document()]
    from_model = pack_for_model(vlm, docs, cp_size=2, pad_to_multiple_of=8)
    from_config = pack_for_model(vlm.config, docs, cp_size=2, pad_to_multiple_of=8)
    assert from_model.keys() == from_config.keys()
    for key, value in from_model.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, from_config[key]), key
    assert from_model["cp_layout"].pieces == from_config["cp_layout"].pieces
    pad = from_model["input_ids"].shape[1] - sum(
        torch.as_tensor(d["input_ids"]).numel() for d in docs
    )
    want = torch.cat([*(_rope_index(vlm, d) for d in docs), torch.arange(pad).expand(3, -1)], 1)
    assert torch.equal(from_config["position_ids"], want[:, None])
    assert from_config["position_ids"].shape == (3, 1, from_config["input_ids"].shape[1])

    mine = torch.arange(27).view(3, 9) * 5  # precomputed: used as they are
    ones = torch.ones(9, dtype=torch.long)
    row = pack_for_model(
        vlm.config,
        [
            {"input_ids": ones, "position_ids": mine},  # [3, L]
            docs[1],  # computed
            {"input_ids": ones, "position_ids": mine[:, None] + 1},  # [3, 1, L]
        ],
    )
    n1 = docs[1]["input_ids"].numel()
    assert torch.equal(row["position_ids"][:, 0, :9], mine)
    assert torch.equal(row["position_ids"][:, 0, 9 : 9 + n1], _rope_index(vlm, docs[1]))
    assert torch.equal(row["position_ids"][:, 0, 9 + n1 :], mine + 1)
    zeros = functools.partial(torch.zeros, dtype=torch.long)
    for bad in (torch.arange(9), zeros(3, 8), zeros(3, 2, 9), zeros(1, 3, 9), torch.zeros(3, 9)):
        with pytest.raises(
            ValueError, match=r"documents\[0\].position_ids must be integer \[3, 9\]"
        ):
            pack_for_model(vlm.config, [{"input_ids": torch.ones(9), "position_ids": bad}])
    text = pack_for_model(vlm.config.text_config, [{"input_ids": torch.ones(5)}])  # a text model's
    assert torch.equal(text["position_ids"], torch.arange(5).expand(3, 1, -1))
    wrong = dict(docs[1], image_grid_thw=torch.tensor([[1, 4, 8]]))
    with pytest.raises(ValueError, match=r"documents\[1\]: image run 0 has 4 tokens"):
        pack_for_model(vlm.config, [docs[0], wrong])


def _hidden_separately(model, docs):
    """(transformers' final hidden states of each document run alone [sum L, H], their mean
    next-token CE)."""
    hidden, total, count = [], 0.0, 0
    for doc in docs:
        h = model.model(**_alone(doc), use_cache=False).last_hidden_state[0]
        ids = torch.as_tensor(doc["input_ids"]).reshape(-1)
        total = total + F.cross_entropy(model.lm_head(h)[:-1], ids[1:], reduction="sum")
        count += ids.numel() - 1
        hidden.append(h)
    return torch.cat(hidden), total / count


class _Calls:
    """Counts forward calls of a module (a forward hook) and the grids it was called with."""

    def __init__(self, module):
        self.grids = []
        self.handle = module.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output):
        self.grids.append(kwargs["grid_thw"] if "grid_thw" in kwargs else args[1])


@pytest.mark.parametrize("encoder", ["model's", "vision=", "inputs_embeds="])
def test_packed_hidden_states_with_images_and_videos_equal_separate_documents(encoder):
    """``inputs_embeds=``: the row embedded first (:func:`embed_packed_row`, as a caller that
    also reads the embeddings does), then passed in: the same hidden states and gradients."""
    model = tiny_vlm()
    reference = copy.deepcopy(model)
    docs = [*documents(), mixed_document()]  # images and videos in one row, and in one document
    ref_hidden, ref_loss = _hidden_separately(reference, docs)
    ref_loss.backward()
    enable_packing(model)
    row = pack_for_model(model, docs, pad_to_multiple_of=8)
    assert row["pixel_values"].numel() and row["pixel_values_videos"].numel()
    vision = None
    if encoder == "vision=":

        def vision(pixels, grid):
            return model.model.visual(pixels, grid_thw=grid).pooler_output

    calls = _Calls(model.model.visual)
    if encoder == "inputs_embeds=":
        embeds = embed_packed_row(model, row)
        assert embeds.shape == (*row["input_ids"].shape, model.config.text_config.hidden_size)
        hidden, labels, mask = packed_hidden_states(model, row, inputs_embeds=embeds)
    else:
        hidden, labels, mask = packed_hidden_states(model, row, vision=vision)
    calls.handle.remove()
    assert len(calls.grids) == 1  # one tower call for the row's images AND videos
    assert torch.equal(calls.grids[0], torch.cat([row["image_grid_thw"], row["video_grid_thw"]]))
    n = ref_hidden.shape[0]
    assert_close(hidden[0, :n], ref_hidden, **TOL, name="hidden states")
    assert mask[0, :n].all() and not mask[0, n:].any()
    loss = F.cross_entropy(model.lm_head(hidden)[0], labels[0], ignore_index=-100)
    assert_close(loss, ref_loss, **TOL, name="loss")
    loss.backward()
    want, got = _grads(reference), _grads(model)
    assert set(got) == set(want) and any("visual" in k for k in got)
    for name, g in want.items():
        assert_close(got[name], g, **TOL, name=f"grad {name}")


def test_one_vision_tower_call_for_images_and_videos():
    vlm = tiny_vlm()
    enable_packing(vlm)
    docs = [*documents(), mixed_document()]
    row = pack_for_model(vlm, docs)
    calls = _Calls(vlm.model.visual)
    with torch.no_grad():
        packed_hidden_states(vlm, row)
        only_videos = {k: v for k, v in row.items() if k not in ("pixel_values", "image_grid_thw")}
        only_videos["input_ids"] = torch.where(row["input_ids"] == IMAGE, 1, row["input_ids"])
        packed_hidden_states(vlm, only_videos)
    calls.handle.remove()
    assert len(calls.grids) == 2  # once per row, whatever kinds it holds
    assert torch.equal(calls.grids[0], torch.cat([row["image_grid_thw"], row["video_grid_thw"]]))
    assert torch.equal(calls.grids[1], row["video_grid_thw"])


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


def test_the_backends_reach_every_adapted_layer_and_a_named_one_that_cannot_run_says_why():
    """``enable_packing``'s kernels are the ones the layers call: a named backend that cannot
    run (flash-attn / fla on CPU) raises its reason in the forward; ``torch`` runs. The resolvers
    name what ``auto`` picks on a device type."""
    from cp_varlen_attn import resolve_attention_backend, resolve_gdn_backend

    assert resolve_attention_backend("auto", "cpu") == resolve_gdn_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="backend='fla' needs the flash-linear-attention"):
        resolve_gdn_backend("fla", "cpu")
    docs = documents()
    for attention, gdn, error in (
        ("flash", "torch", "backend='flash' needs the flash-attn package"),
        ("torch", "fla", "backend='fla' needs the flash-linear-attention package"),
    ):
        model = tiny_vlm()
        enable_packing(model, attention_backend=attention, gdn_backend=gdn)
        backends = {
            getattr(m, name)
            for m in model.modules()
            for name in ("attention_backend", "gdn_backend")
            if hasattr(m, name)
        }
        assert backends == {attention, gdn}
        with pytest.raises(ValueError, match=error):
            model(**pack_for_model(model, docs))
    model = tiny_vlm()
    enable_packing(model, attention_backend="torch", gdn_backend="torch")
    model(**pack_for_model(model, docs))
