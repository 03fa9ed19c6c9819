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
from qwen35_trainer.model.lora.adapters import is_adapter

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


def _peft_adapter(base, out, *, alpha=12, saved=("lm_head",)):
    """An adapter written by PEFT itself on transformers' model from ``base``: rank 4 on every
    projection the recipe adapts and on the fused experts (``target_parameters``), ``alpha``,
    ``saved`` as ``modules_to_save``; every weight random (B too), then ``save_pretrained``."""
    from peft import LoraConfig, get_peft_model

    from qwen35_trainer.recipe import LORA_TARGETS

    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=alpha, target_modules=[t for t in LORA_TARGETS if t != "experts"],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
                        modules_to_save=list(saved))  # fmt: skip
    peft_model = get_peft_model(hf, config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                param.copy_(param + 0.1 * torch.randn(param.shape, generator=g))
    peft_model.save_pretrained(out)
    return peft_model


INIT = "model.lora={{rank: 4, alpha: 64, expert_rank: 4, train_modules: [lm_head], init_from: {}}}"


def test_init_from_a_peft_adapter_gives_peft_s_logits(base, tmp_path):
    """A PEFT adapter (alpha 12 against the recipe's 64: B is rescaled), experts in PEFT's
    ``target_parameters`` layout and ``lm_head`` saved in full: our first-step logits equal
    PEFT's on that adapter."""
    peft_model = _peft_adapter(base, tmp_path / "adapter")
    recipe = _recipe(base, INIT.format(tmp_path / "adapter"))
    ours = build_model(recipe.model)
    batch = global_batch(recipe.model, recipe.data, 0, step=1, dp=1)
    ours.eval()
    peft_model.eval()
    with torch.no_grad():
        got, want = hf_forward(ours, batch).logits, hf_forward(peft_model, batch).logits
    # PEFT forms each expert's delta B A, we multiply through the rank: fp32 rounding apart
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_init_from_our_own_exports_round_trips(base, tmp_path):
    """A run's ``peft`` and ``per_expert`` exports, started from, give the run's logits (the
    folded scale converted back to the recipe's)."""
    from qwen35_trainer.model.lora.peft_export import write_adapter

    sets = (LORA, "train.steps=2")
    recipe = _recipe(base, *sets)
    result = train(recipe)
    trained = build_model(recipe.model)
    trained.load_state_dict(result.state_dict())
    batch = global_batch(recipe.model, recipe.data, 0, step=3, dp=1)
    trained.eval()
    with torch.no_grad():
        want = hf_forward(trained, batch).logits
    for layout in ("peft", "per_expert"):
        out = tmp_path / layout
        write_adapter(trained, recipe.model.lora, out, lambda t: t,
                      per_expert=layout == "per_expert", base=str(base), writer=True)  # fmt: skip
        lora = LORA.removesuffix("}") + f", init_from: {out}}}"
        started = build_model(_recipe(base, lora).model)
        started.eval()
        with torch.no_grad():
            got = hf_forward(started, batch).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=layout)


def test_init_from_refuses_an_adapter_of_another_shape(base, tmp_path):
    _peft_adapter(base, tmp_path / "adapter")
    with pytest.raises(
        ValueError, match=r"init_from .* does not fit .*rank 8.*the file's adapter of rank 4"
    ):
        build_model(
            _recipe(
                base, INIT.format(tmp_path / "adapter").replace("rank: 4,", "rank: 8,", 1)
            ).model
        )
    narrow = "{rank: 4, alpha: 4, expert_rank: 4, targets: [q_proj, experts], train_modules: [lm_head], init_from: %s}"
    with pytest.raises(ValueError, match=r"tensor\(s\) the recipe has no place for"):
        build_model(_recipe(base, f"model.lora={narrow % (tmp_path / 'adapter')}").model)
    with pytest.raises(ValueError, match=r"modules_to_save \['lm_head'\] are saved in the adapter"):
        build_model(
            _recipe(
                base, INIT.format(tmp_path / "adapter").replace("train_modules: [lm_head], ", "")
            ).model
        )


def test_init_from_says_what_it_loaded_and_what_starts_from_the_base(base, tmp_path, caplog):
    """The log names the file, its r / lora_alpha / scale against the recipe's, the modules
    trained in full it loaded, and those the recipe trains in full that the folder did not
    save (they start from the base checkpoint); a folder that is not there is said to be
    missing."""
    _peft_adapter(base, tmp_path / "adapter")
    lora = INIT.format(tmp_path / "adapter").replace("[lm_head]", "[lm_head, mlp.gate]")
    with caplog.at_level("INFO", logger="qwen35_trainer"):
        build_model(_recipe(base, lora).model)
    said = caplog.text
    assert f"{tmp_path / 'adapter' / 'adapter_model.safetensors'}" in said, said
    assert "the file's r=4, lora_alpha=12 (scale 3)" in said, said
    assert "the recipe's scale 16 (rank 4, alpha 64)" in said, said
    assert "modules trained in full loaded: ['lm_head']" in said, said
    assert "mlp.gate" in said and "start from the base checkpoint" in said, said
    with pytest.raises(ValueError, match=r"init_from: .*/nowhere does not exist"):
        build_model(_recipe(base, INIT.format(tmp_path / "nowhere")).model)


def test_a_run_started_from_an_adapter_resumes_exactly(base, tmp_path):
    _peft_adapter(base, tmp_path / "adapter")
    lora = INIT.format(tmp_path / "adapter")
    with train(_recipe(base, lora, "train.steps=3")) as whole:  # read before the next run
        theirs = whole.state_dict()
    _ = train(_recipe(base, lora, "train.steps=2", f"train.checkpoint_dir={tmp_path / 'ckpt'}"))
    resumed = train(
        _recipe(base, lora, "train.steps=3", f"train.checkpoint_dir={tmp_path / 'ckpt'}")
    )
    assert [log.loss for log in resumed.logs] == [whole.logs[2].loss]
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, theirs[name]), name
