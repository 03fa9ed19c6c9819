"""LoRA (``model.lora``) in one process, against independent references: the base model (B = 0
is the base bit for bit), transformers' own model with the merged weights, PEFT loading the
exported adapter onto transformers' model, and the per-expert adapters merged by hand.

The base is a transformers checkpoint (``save_pretrained``, per-expert experts) with its
processor; the adapters have ``alpha != rank`` and the experts their own rank, so a scale left
unfolded, or per-expert ranks confused, changes the logits."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from chat_fixtures import MODEL, checkpoint_dir
from helpers import ONE_PROCESS, SYNTHETIC, hf_forward

from qwen35_trainer import build_model, load_recipe, train
from qwen35_trainer.cli import main
from qwen35_trainer.data import global_batch
from qwen35_trainer.demo.dataset import make_demo
from qwen35_trainer.model.lora.adapters import is_adapter
from qwen35_trainer.model.weights.saving import creation_mode

LORA = "model.lora={rank: 4, alpha: 12, expert_rank: 8}"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    demo = make_demo(root / "demo", train_rows=2, heldout_rows=1)
    return checkpoint_dir(root / "base", demo / "processor")


def _sets(base, *more):
    return [*ONE_PROCESS, *SYNTHETIC, *MODEL, f"model.path={base}", *more]


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory):
    """3 steps of LoRA from the base, checkpointed: the recipe, the run's logs and state (read
    before a later run releases it) and the checkpoint folder."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    recipe = load_recipe("tiny", _sets(base, LORA, "train.steps=3", f"train.checkpoint_dir={ckpt}"))
    with train(recipe) as result:
        state = result.state_dict()
    return recipe, SimpleNamespace(logs=result.logs, state_dict=lambda: state), ckpt


def _trained(recipe, result):
    """The trained LoRA model, unsharded (its state loaded into a fresh build)."""
    model = build_model(recipe.model)
    model.load_state_dict(result.state_dict())
    return model


def _logits(model, recipe, step=5):
    batch = global_batch(recipe.model, recipe.data, 0, step=step, dp=1)
    model.eval()
    with torch.no_grad():
        return hf_forward(model, batch).logits


def test_zero_b_is_the_base_bit_for_bit(base):
    plain = load_recipe("tiny", _sets(base))
    adapted = load_recipe("tiny", _sets(base, LORA))
    theirs, ours = build_model(plain.model), build_model(adapted.model)
    assert torch.equal(_logits(ours, adapted), _logits(theirs, plain))
    names = [n for n, _ in ours.named_parameters()]
    assert any(".mlp.experts.lora_gate_up_A" in n for n in names)
    assert any(n.endswith("linear_attn.in_proj_qkv.lora_B") for n in names)
    assert any(n.endswith("self_attn.o_proj.lora_A") for n in names)
    assert [n for n, p in ours.named_parameters() if p.requires_grad] == [
        n for n in names if is_adapter(n)
    ]
    first = [
        train(load_recipe("tiny", _sets(base, *lora, "train.steps=1"))) for lora in ((), (LORA,))
    ]
    assert first[0].logs[0].loss == first[1].logs[0].loss


def test_only_the_adapters_train_and_checkpoints_hold_them(base, trained):
    recipe, result, ckpt = trained
    start = build_model(recipe.model)  # the base with fresh adapters (B = 0)
    after = result.state_dict()
    for name, param in start.named_parameters():
        if not is_adapter(name):
            assert torch.equal(param, after[name]), name  # frozen
    moved = [
        n for n, p in start.named_parameters() if is_adapter(n) and not torch.equal(p, after[n])
    ]
    assert any(n.endswith("experts.lora_down_B") for n in moved), moved
    assert any(n.endswith("self_attn.q_proj.lora_B") for n in moved), moved
    metadata = (ckpt / "step_000003" / ".metadata").read_bytes()
    assert b"lora_B" in metadata and b"embed_tokens" not in metadata  # adapters only


def test_merged_export_computes_the_adapted_model(base, trained, tmp_path):
    recipe, result, ckpt = trained
    ours = _logits(_trained(recipe, result), recipe)
    out = tmp_path / "merged"
    assert (
        main(
            [
                "export",
                "tiny",
                *(a for s in _sets(base, LORA) for a in ("--set", s)),
                str(ckpt),
                str(out),
                "--lora",
                "merged",
            ]
        )
        == 0
    )
    merged = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(out)
    torch.testing.assert_close(_logits(merged, recipe), ours, rtol=1e-5, atol=1e-5)
    assert not torch.equal(
        _logits(build_model(load_recipe("tiny", _sets(base)).model), recipe), ours
    )


def _export(base, ckpt, out, fmt):
    sets = _sets(base, LORA)
    return main(
        [
            "export",
            "tiny",
            *(a for s in sets for a in ("--set", s)),
            str(ckpt),
            str(out),
            "--lora",
            fmt,
        ]
    )


def test_peft_loads_the_adapter_onto_transformers_model(base, trained, tmp_path):
    """Export (a) through PEFT itself: ``PeftModel.from_pretrained`` on transformers' Qwen3.5
    MoE model from the base checkpoint gives our logits."""
    from peft import PeftModel

    recipe, result, ckpt = trained
    ours = _logits(_trained(recipe, result), recipe)
    out = tmp_path / "peft"
    assert _export(base, ckpt, out, "peft") == 0
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(modes.values()) == {oct(creation_mode())}, modes  # the adapter too, not 0600
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    assert config["lora_alpha"] == config["r"] == 4 and config["base_model_name_or_path"] == str(
        base
    )
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(base)
    peft_model = PeftModel.from_pretrained(hf, out)
    torch.testing.assert_close(_logits(peft_model, recipe), ours, rtol=1e-5, atol=1e-5)


def test_per_expert_adapters_merge_to_the_same_weights(base, trained, tmp_path):
    """Export (b), merged by hand from its 2-D per-expert keys onto the base, equals export (c)."""
    from safetensors.torch import load_file

    recipe, _, ckpt = trained
    assert _export(base, ckpt, tmp_path / "b", "per_expert") == 0
    assert _export(base, ckpt, tmp_path / "c", "merged") == 0
    adapter = load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(base)
    state = hf.state_dict()
    with torch.no_grad():
        for key in [k for k in adapter if k.endswith("lora_A.weight")]:
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            delta = adapter[key.replace("lora_A", "lora_B")] @ adapter[key]
            *parent, e, proj = module.split(".")
            if parent[-1] == "experts":  # experts.{e}.{gate,up,down}_proj
                stacked = state[
                    ".".join(parent) + (".down_proj" if proj == "down_proj" else ".gate_up_proj")
                ]
                rows = delta.shape[0]
                at = {"gate_proj": slice(0, rows), "up_proj": slice(rows, 2 * rows)}.get(
                    proj, slice(None)
                )
                stacked[int(e)][at] += delta
            else:
                state[f"{module}.weight"] += delta
    merged = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "c")
    for name, value in merged.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(_logits(hf, recipe), _logits(merged, recipe), rtol=1e-5, atol=1e-5)


def test_resume_is_exact_from_an_adapter_checkpoint(base, trained, tmp_path):
    _, result, _ = trained
    first = load_recipe(
        "tiny", _sets(base, LORA, "train.steps=2", f"train.checkpoint_dir={tmp_path}")
    )
    train(first)
    resumed = train(
        load_recipe("tiny", _sets(base, LORA, "train.steps=3", f"train.checkpoint_dir={tmp_path}"))
    )
    assert [log.loss for log in resumed.logs] == [result.logs[2].loss]
    theirs = result.state_dict()
    for name, param in resumed.state_dict().items():
        assert torch.equal(param, theirs[name]), name


def test_a_target_that_matches_nothing_is_refused():
    from helpers import tiny

    gdn_only = "model.text.layer_types=[linear_attention, linear_attention, linear_attention, linear_attention]"
    build_model(tiny("model.lora={targets: [in_proj_qkv, experts]}", gdn_only).model)
    with pytest.raises(ValueError, match=r"model.lora.targets \['q_proj'\] match no projection"):
        build_model(tiny("model.lora={targets: [q_proj, experts]}", gdn_only).model)


def test_expert_lora_with_transformer_engine_is_refused_with_the_reason():
    from helpers import tiny

    from qwen35_trainer.model.kernels import resolve_kernels

    with pytest.raises(ValueError, match=r"model.expert_backend=te: expert LoRA .* torch grouped"):
        resolve_kernels(tiny("model.lora={rank: 4}", "model.expert_backend=te"), "cuda")
    with_auto = resolve_kernels(tiny("model.lora={rank: 4}"), "cpu")
    assert with_auto.record()["experts"] == "torch"
