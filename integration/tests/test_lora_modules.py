"""LoRA as people run it, one process: modules trained in full beside the adapters
(``model.lora.train_modules``, PEFT's ``modules_to_save``) against PEFT itself and the merged
export. The base is the tiny recipe's model with its multi-token-prediction head, exported
(:func:`fp8_fixtures.export_base`)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from fp8_fixtures import export_base
from helpers import hf_forward, tiny
from safetensors.torch import load_file

from qwen35_trainer import build_model, train
from qwen35_trainer.cli import main
from qwen35_trainer.data import global_batch
from qwen35_trainer.model.lora import is_adapter

TRAINED = "[mlp.gate, lm_head, mtp, norm]"
LORA = f"model.lora={{rank: 4, alpha: 64, expert_rank: 8, train_modules: {TRAINED}}}"
PACKED = ("data.packing=true", "model.mtp_layers=1")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return export_base(tmp_path_factory.mktemp("lora_modules") / "base")


def _recipe(base, *more):
    return tiny(f"model.path={base}", *PACKED, *more)


def _trains_in_full(name: str) -> bool:
    """Whether parameter ``name`` belongs to a module of ``TRAINED`` (a module whose name ends
    with one, PEFT's rule: ``norm`` is every norm, ``input_layernorm`` and ``q_norm`` too)."""
    module = name.rsplit(".", 1)[0]
    return module.endswith(("lm_head", "mlp.gate", "norm")) or name.startswith("mtp.")


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    recipe = _recipe(base, LORA, "train.steps=3", f"train.checkpoint_dir={ckpt}")
    return recipe, train(recipe), ckpt


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_named_modules_train_in_full_beside_the_adapters(base, dtype):
    """Everything of the named modules moves (in bf16 too, where one process casts them for
    the compute without wrapping the rest of the model), adapters move, the rest is frozen."""
    recipe = _recipe(base, LORA, "train.steps=2", f"train.dtype={dtype}")
    start = build_model(recipe.model)
    after = train(recipe).state_dict()
    moved = {n for n, p in start.named_parameters() if not torch.equal(p, after[n].to(p.dtype))}
    full = {n for n, _ in start.named_parameters() if _trains_in_full(n)}
    assert {n for n in moved if not is_adapter(n)} == full, sorted(full ^ moved)[:5]
    assert any(n.startswith("mtp.layers.0.mlp.experts.") for n in full)
    assert {n for n, p in start.named_parameters() if p.requires_grad} == full | {
        n for n, _ in start.named_parameters() if is_adapter(n)
    }


def test_the_checkpoint_and_the_merged_export_carry_them(base, trained, tmp_path):
    _, result, ckpt = trained
    metadata = (ckpt / "step_000003" / ".metadata").read_bytes()
    assert b"lm_head.weight" in metadata and b"mtp.fc.weight" in metadata
    assert b"embed_tokens" not in metadata
    sets = [a for s in ("parallel.dp=1", "parallel.cp=1", "parallel.ep=1", "data.path=null",
            "data.processor=null", "data.eval_path=null", f"model.path={base}", *PACKED, LORA)
            for a in ("--set", s)]  # fmt: skip
    out = tmp_path / "merged"
    assert main(["export", "tiny", *sets, str(ckpt), str(out), "--lora", "merged",
                 "--dtype", "float32"]) == 0  # fmt: skip
    written = {}
    for file in out.glob("*.safetensors"):
        written.update(load_file(str(file)))
    state = result.state_dict()
    for name in (
        "lm_head.weight",
        "mtp.fc.weight",
        "model.language_model.layers.0.mlp.gate.weight",
    ):
        assert torch.equal(written[name], state[name]), name


def test_peft_loads_the_modules_to_save_and_gives_our_logits(base, trained, tmp_path):
    """The ``peft`` export through PEFT itself: ``modules_to_save`` lists the modules, their
    weights sit where PEFT saves them, and ``PeftModel.from_pretrained`` on transformers' model
    from the base gives our logits (the MTP head is not part of PEFT's model; the merged export
    carries it)."""
    from peft import PeftModel

    recipe, result, ckpt = trained
    sets = [a for s in ("parallel.dp=1", "parallel.cp=1", "parallel.ep=1", "data.path=null",
            "data.processor=null", "data.eval_path=null", f"model.path={base}", *PACKED, LORA)
            for a in ("--set", s)]  # fmt: skip
    out = tmp_path / "peft"
    assert main(["export", "tiny", *sets, str(ckpt), str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["mlp.gate", "lm_head", "norm"]
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert "base_model.model.lm_head.weight" in saved
    assert "base_model.model.model.language_model.layers.2.mlp.gate.weight" in saved
    assert not any(".mtp." in k or k.startswith("base_model.model.mtp") for k in saved)
    ours = build_model(recipe.model)
    ours.load_state_dict(result.state_dict())
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, out)
    batch = global_batch(recipe.model, recipe.data, 0, step=5, dp=1)
    ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            hf_forward(peft_model, batch).logits,
            hf_forward(ours, batch).logits,
            rtol=1e-5,
            atol=1e-5,
        )


def test_names_that_match_nothing_or_hold_adapters_are_refused(base):
    with pytest.raises(ValueError, match=r"train_modules \['lm_haed'\] match no module"):
        build_model(_recipe(base, "model.lora={rank: 4, train_modules: [lm_haed]}").model)
    with pytest.raises(ValueError, match=r"must not hold LoRA projections .*self_attn holds"):
        build_model(_recipe(base, "model.lora={rank: 4, train_modules: [self_attn]}").model)
