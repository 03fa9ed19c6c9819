"""The multi-token-prediction head (:mod:`qwen35_trainer.model.mtp`) against an independent
reference, and its checkpoints in and out.

Reference: a plain loop over the documents of a packed row, each run ALONE through the
unpacked model (transformers' own forward: its embedding merge, its M-RoPE positions, causal
SDPA), with the MTP head computed by hand from its weights — RMSNorms, ``fc``, the head — and
its decoder layer a fresh transformers ``Qwen3_5MoeDecoderLayer`` (transformers' own MoE block)
loaded with the trained layer's weights and run with an explicit causal mask. The row holds
documents of 1 and 2 tokens (no targets) and labels masked by hand. Layouts (CP, EP, TP, FSDP,
AC) are compared with one process in test_train_dp.py.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import tiny
from safetensors.torch import load_file, save_file
from served_fields import check_served_fields

from dist_testkit import assert_close
from qwen35_trainer import TrainingObjective, build_config, build_model, train
from qwen35_trainer.data import IGNORE_INDEX, Sample, rank_samples
from qwen35_trainer.data.packing import pack
from qwen35_trainer.model.packed import enable_packing
from qwen35_trainer.parallel import Layout
from qwen35_trainer.supervise.run_folder import step_records
from qwen35_trainer.train.step import count_targets

MTP = ("model.expert_backend=torch", "data.samples_per_rank=3")


def _text(ids, labels=None):
    ids = torch.tensor(ids)
    return Sample(
        ids, ids.clone() if labels is None else torch.tensor(labels), torch.zeros_like(ids)
    )


def _documents(r):
    """Image documents of the synthetic stream around text documents of 1, 2 and 9 tokens, one
    with labels masked in its middle (as a chat template masks a user turn)."""
    images = rank_samples(r.model, r.data, step=0, rank=0, dp=1)
    m = IGNORE_INDEX
    masked = _text([5, 17, 33, 2, 8, 61, 40, 12, 9], [5, 17, m, m, m, 61, 40, 12, 9])
    return [images[0], _text([7]), masked, _text([3, 4]), *images[1:]]


def _rms(x, weight, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())


def _reference(model, layers, docs):
    """Each depth's MTP loss (sum over documents / its valid targets), by hand (module
    docstring), each depth's valid-target count, and depth 1's targets its arg-max gets right."""
    vlm, mtp, head = model.model, model.mtp, model.lm_head.weight
    text, eps = vlm.language_model, model.config.text_config.rms_norm_eps
    captured = {}

    def capture(module, args, kwargs):
        captured.update(kwargs)

    hook = text.register_forward_pre_hook(capture, with_kwargs=True)
    sums, counts, correct = [0.0] * len(layers), [0] * len(layers), 0
    for doc in docs:
        n = len(doc)
        media = {}
        if doc.pixel_values.numel():
            media = {"pixel_values": doc.pixel_values, "image_grid_thw": doc.image_grid_thw}
        out = vlm(
            input_ids=doc.input_ids[None],
            attention_mask=torch.ones(1, n, dtype=torch.long),
            mm_token_type_ids=doc.mm_token_type_ids[None],
            use_cache=False,
            **media,
        )
        embeds, positions = captured["inputs_embeds"][0], captured["position_ids"]
        if positions is None:  # text only: the text model counts 0 .. n-1 itself
            positions = torch.arange(n).view(1, 1, n).expand(3, 1, n)
        elif positions.shape[0] == 4:  # transformers' [text; t, h, w] rows
            positions = positions[1:]
        hidden = out.last_hidden_state[0]
        for d, layer in enumerate(layers, start=1):
            m = n - d  # positions 0 .. n-d-1 have an input token t + d
            if m < 1:
                break
            x = torch.cat([_rms(embeds[d:], mtp.pre_fc_norm_embedding.weight, eps),
                           _rms(hidden[:m], mtp.pre_fc_norm_hidden.weight, eps)], -1)  # fmt: skip
            x = (x @ mtp.fc.weight.T)[None]
            rope = text.rotary_emb(x, positions[..., :m])
            causal = torch.full((m, m), float("-inf")).triu(1)[None, None]
            hidden = _rms(layer(x, position_embeddings=rope, attention_mask=causal)[0],
                          mtp.norm.weight, eps)  # fmt: skip
            targets = doc.labels[d + 1 :]  # position t predicts token t + 1 + d
            logits = hidden[: m - 1] @ head.T
            sums[d - 1] = sums[d - 1] + F.cross_entropy(
                logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            valid = targets != IGNORE_INDEX
            counts[d - 1] += int(valid.sum())
            if d == 1:
                correct += int((logits.argmax(-1) == targets)[valid].sum())
    hook.remove()
    return [s / c for s, c in zip(sums, counts, strict=True)], counts, correct


def _transformers_layers(model):
    """The MTP layers as fresh transformers decoder layers (transformers' own MoE block) with
    the trained layers' weights, eager attention (the mask is passed explicitly)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    config = copy.copy(model.config.text_config)
    config.layer_types = ["full_attention"] * len(model.mtp.layers)
    config._attn_implementation = "eager"
    layers = []
    for i, ours in enumerate(model.mtp.layers):
        layer = Qwen3_5MoeDecoderLayer(config, i)
        layer.load_state_dict(ours.state_dict(), strict=True)
        layers.append(layer)
    return layers


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_loss_and_gradients_equal_documents_run_alone(depth):
    r = tiny(*MTP, f"model.mtp_layers={depth}")
    model = build_model(r.model)
    docs = _documents(r)
    reference = copy.deepcopy(model)
    layers = _transformers_layers(reference)
    want, want_counts, _ = _reference(reference, layers, docs)
    assert want_counts[0] > 0 and (depth == 1 or want_counts[1] > 0)

    enable_packing(model)
    objective = TrainingObjective(model)
    batch, packed = pack(docs, model.config, pad_token_id=0)
    _, counts = count_targets([(batch, packed)], Layout(), torch.device("cpu"), depth)
    assert list(counts) == want_counts
    shares = objective(batch, packed=packed, num_valid_mtp=counts)
    assert shares.mtp.shape == (depth,)
    for d in range(depth):
        assert_close(shares.mtp[d], want[d], rtol=1e-5, atol=1e-7, name=f"mtp loss depth {d + 1}")
    shares.mtp.sum().backward()
    sum(want).backward()
    refs = dict(reference.named_parameters())
    for i, layer in enumerate(layers):
        refs.update({f"mtp.layers.{i}.{k}": p for k, p in layer.named_parameters()})
    checked = 0
    for name, param in model.named_parameters():
        ref = refs[name].grad
        if param.grad is None:
            assert ref is None or not ref.any(), name
            continue
        assert_close(param.grad, ref, rtol=1e-5, atol=1e-7, name=name)
        checked += 1
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert {"mtp.fc.weight", "lm_head.weight", "model.language_model.embed_tokens.weight"} <= grads
    assert any(n.startswith("model.visual.") for n in grads)  # the features the head reads
    assert checked > 50


def test_mtp_accuracy_counts_depth_one_targets():
    """``mtp_correct``: how many depth-1 targets (token t + 2) the head's arg-max gets right,
    equal to the count from the reference's logits (after a few SGD steps on the MTP loss, so
    that the head predicts some targets)."""
    r = tiny(*MTP, "model.mtp_layers=1")
    model = build_model(r.model)
    docs = _documents(r)
    packed_model = copy.deepcopy(model)
    enable_packing(packed_model)
    objective = TrainingObjective(packed_model)
    batch, packed = pack(docs, packed_model.config, pad_token_id=0)
    optimizer = torch.optim.SGD(objective.parameters(), lr=5.0)
    for _ in range(5):
        objective(batch, packed=packed).mtp.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        shares = objective(batch, packed=packed, accuracy=True)
        model.load_state_dict(packed_model.state_dict())
        _, _, want = _reference(model, _transformers_layers(model), docs)
    assert want > 0 and int(shares.mtp_correct) == want


def test_the_head_needs_packed_rows():
    with pytest.raises(ValueError, match=r"model.mtp_layers=1 needs data.packing"):
        train(tiny("model.mtp_layers=1", "data.packing=false", "train.steps=1"))


def test_a_run_reports_the_mtp_loss_and_held_out_accuracy(tmp_path):
    """metrics.jsonl, the console line and loss.png carry the head's numbers; ``loss`` is the
    minimised total ``ce + aux_coef * aux + mtp_loss_weight * mean(mtp_loss)``."""
    from qwen35_trainer.supervise.console import Console

    out = tmp_path / "run"
    result = train(
        tiny(
            "model.mtp_layers=1",
            "train.steps=2",
            "train.eval_every=2",
            "train.mtp_loss_weight=0.3",
            f"train.output_dir={out}",
        )
    )
    last = result.logs[-1]
    coef = result.objective.model.config.text_config.router_aux_loss_coef
    assert last.loss == pytest.approx(last.ce + coef * last.aux + 0.3 * last.mtp_loss[0])
    assert last.eval_mtp_accuracy is not None and 0 <= last.eval_mtp_accuracy <= 1
    records = step_records(out / "metrics.jsonl")
    assert len(records[-1]["mtp_loss"]) == 1 and records[-1]["eval_mtp_accuracy"] is not None
    assert (out / "loss.png").is_file()
    line = Console(2, 1, printing=False).line(last)
    assert f"mtp_loss {last.mtp_loss[0]:.4f}" in line and "mtp_accuracy" in line


# --- checkpoints in and out -------------------------------------------------------------


def _public_mtp(model, seed: int) -> dict[str, torch.Tensor]:
    """Random ``mtp.*`` tensors of ``model``'s head under the public checkpoints' names: the
    experts one tensor per expert and projection (gate, up, down), the rest as in memory."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in model.state_dict().items():
        if not name.startswith("mtp."):
            continue
        value = torch.randn(param.shape, generator=g) * 0.05
        if name.endswith("experts.gate_up_proj"):
            base, half = name.removesuffix(".gate_up_proj"), param.shape[1] // 2
            for e in range(param.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = value[e, :half].clone()
                out[f"{base}.{e}.up_proj.weight"] = value[e, half:].clone()
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix(".down_proj")
            for e in range(param.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = value[e].clone()
        else:
            out[name] = value
    return out


def _stacked(public: dict[str, torch.Tensor], name: str, experts: int) -> torch.Tensor:
    base, proj = name.rsplit(".", 1)
    if proj == "down_proj":
        return torch.stack([public[f"{base}.{e}.down_proj.weight"] for e in range(experts)])
    return torch.stack(
        [
            torch.cat(
                [public[f"{base}.{e}.gate_proj.weight"], public[f"{base}.{e}.up_proj.weight"]]
            )
            for e in range(experts)
        ]
    )


@pytest.fixture(scope="module")
def public_checkpoint(tmp_path_factory):
    """transformers' save_pretrained of the tiny model plus a file of ``mtp.*`` tensors under
    the public names (as the published checkpoints ship them beside the model's)."""
    path = tmp_path_factory.mktemp("public")
    r = tiny("model.mtp_layers=1")
    torch.manual_seed(7)
    transformers.Qwen3_5MoeForConditionalGeneration(build_config(r.model)).save_pretrained(path)
    mtp = _public_mtp(build_model(r.model), seed=3)
    save_file(mtp, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    return path, mtp


def test_a_checkpoint_with_mtp_loads_every_mtp_tensor(public_checkpoint):
    path, public = public_checkpoint
    model = build_model(tiny("model.mtp_layers=1", f"model.weights={path}").model)
    experts = model.config.text_config.num_experts
    loaded = {k: v for k, v in model.state_dict().items() if k.startswith("mtp.")}
    assert len(loaded) == 19
    for name, value in loaded.items():
        if ".experts." in name:
            assert torch.equal(value, _stacked(public, name, experts)), name
        else:
            assert torch.equal(value, public[name]), name


def test_without_the_head_the_checkpoints_mtp_is_skipped(public_checkpoint, caplog):
    path, _ = public_checkpoint
    with caplog.at_level(logging.INFO, logger="qwen35_trainer"):
        model = build_model(tiny(f"model.weights={path}").model)
    assert not hasattr(model, "mtp")
    assert "skipped 41 multi-token-prediction tensors" in caplog.text


def test_a_checkpoint_without_mtp_is_refused_unless_asked_to_initialise(tmp_path, caplog):
    r = tiny("model.mtp_layers=1")
    torch.manual_seed(0)
    transformers.Qwen3_5MoeForConditionalGeneration(build_config(r.model)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no multi-token-prediction tensors \(mtp\.\*\) on disk"):
        build_model(tiny("model.mtp_layers=1", f"model.weights={tmp_path}").model)
    with caplog.at_level(logging.WARNING, logger="qwen35_trainer"):
        model = build_model(
            tiny(
                "model.mtp_layers=1", f"model.weights={tmp_path}", "model.init_missing_mtp=true"
            ).model
        )
    assert "start from the seeded initialisation" in caplog.text
    seeded = build_model(r.model).state_dict()
    for name, value in model.state_dict().items():
        if name.startswith("mtp."):
            assert torch.equal(value, seeded[name]), name


def test_export_writes_the_public_mtp_names_with_the_trained_values(public_checkpoint, tmp_path):
    path, public = public_checkpoint
    result = train(
        tiny(
            "model.mtp_layers=1",
            f"model.weights={path}",
            "train.steps=1",
            f"train.export_dir={tmp_path}",
        )
    )
    written = {}
    for file in tmp_path.glob("*.safetensors"):
        written.update({k: v for k, v in load_file(file).items() if k.startswith("mtp.")})
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in public.items()}
    trained = result.state_dict()
    experts = result.objective.model.config.text_config.num_experts
    for name, value in trained.items():
        if not name.startswith("mtp."):
            continue
        exported = _stacked(written, name, experts) if ".experts." in name else written[name]
        assert torch.equal(exported, value), name
        assert not torch.equal(exported, _stacked(public, name, experts) if ".experts." in name
                               else public[name]), name  # fmt: skip
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    check_served_fields(config, result.objective.model.config, mtp=True)  # vLLM's, SGLang's
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(written) <= set(index["weight_map"])
    transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path)  # ignores mtp.*
