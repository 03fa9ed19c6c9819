"""``qwen35-train export`` writes a folder servers and ``from_pretrained`` load as it is: into a
copy of the source checkpoint (people keep the tokenizer beside the weights that way) it is
refused, and with ``--overwrite`` the folder holds only the new weights — transformers then
loads the TRAINED weights, not the copy's — under the source's tensor names (per expert, as
``save_pretrained`` wrote them), with ``architectures`` and ``dtype`` in ``config.json`` and
the source's processor, chat template and generation config beside them — the generation
config with the tokenizer's ``<|im_end|>`` as eos, so ``generate`` stops there — every file
with the same mode."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from chat_fixtures import MODEL, checkpoint_dir
from helpers import ONE_PROCESS, SYNTHETIC

from qwen35_trainer import load_recipe, train
from qwen35_trainer.cli import main
from qwen35_trainer.demo.dataset import make_demo
from qwen35_trainer.model.weights.saving import creation_mode


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names |= set(handle.keys())
    return names


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A per-expert source checkpoint with its processor (written by transformers), a run of 2
    steps from it, and its checkpoint."""
    root = tmp_path_factory.mktemp("export")
    demo = make_demo(root / "demo", train_rows=2, heldout_rows=1)
    source = root / "source"
    checkpoint_dir(source, demo / "processor")
    transformers.GenerationConfig(max_new_tokens=7).save_pretrained(source)
    sets = [*ONE_PROCESS, *SYNTHETIC, *MODEL, f"model.path={source}"]
    result = train(
        load_recipe("tiny", [*sets, "train.steps=2", f"train.checkpoint_dir={root / 'ckpt'}"])
    )
    return source, root / "ckpt", sets, result.state_dict()


def _export(sets, checkpoint, out, *flags) -> int:
    return main(
        [
            "export",
            "tiny",
            *(a for s in sets for a in ("--set", s)),
            str(checkpoint),
            str(out),
            *flags,
        ]
    )


def test_export_into_a_copy_of_the_source(trained, tmp_path, capsys):
    source, checkpoint, sets, state = trained
    out = tmp_path / "served"
    shutil.copytree(source, out)
    assert (out / "model.safetensors").is_file()  # what from_pretrained reads first
    assert _export(sets, checkpoint, out) == 2
    assert "is not empty (it holds" in capsys.readouterr().err
    assert _export(sets, checkpoint, out, "--overwrite") == 0
    said = capsys.readouterr().out
    assert "removed the weights" in said and "model.safetensors" in said, said
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {p.name for p in out.glob("*.safetensors")} == set(index["weight_map"].values())
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(out)
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())
    assert _names(out) == _names(source)  # per expert, as the source
    assert any(".mlp.experts.0.gate_proj.weight" in name for name in _names(out))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert config["dtype"] == json.loads((source / "config.json").read_text())["dtype"]
    theirs = transformers.AutoProcessor.from_pretrained(source)
    ours = transformers.AutoProcessor.from_pretrained(out)
    assert ours.chat_template == theirs.chat_template
    text = "<|im_start|>user\ncolour?<|im_end|>\n"
    assert ours.tokenizer(text)["input_ids"] == theirs.tokenizer(text)["input_ids"]
    assert transformers.GenerationConfig.from_pretrained(out).max_new_tokens == 7


def test_config_json_carries_every_field_vllm_and_sglang_read(trained, tmp_path):
    """The merged export's ``config.json`` states, with the model's values, every field the two
    servers' Qwen3.5 loaders read (:mod:`served_fields` names them and the sources), the M-RoPE
    split and the attention period included, and transformers still loads it."""
    from served_fields import check_served_fields

    from qwen35_trainer import build_config

    _, checkpoint, sets, _ = trained
    out = tmp_path / "served"
    assert _export(sets, checkpoint, out) == 0
    written = json.loads((out / "config.json").read_text())
    check_served_fields(written, build_config(load_recipe("tiny", sets).model))
    assert written["text_config"]["full_attention_interval"] == 4
    loaded = transformers.AutoConfig.from_pretrained(out).text_config
    assert loaded.layer_types == written["text_config"]["layer_types"]


def test_generate_stops_at_the_end_of_turn_the_generation_config_names(trained, tmp_path):
    """The export's ``generation_config.json`` holds the source's settings and the tokenizer's
    ``<|im_end|>`` as eos and its pad token as pad (the source's file had neither), so
    ``generate`` on the exported model stops once ``<|im_end|>`` comes: here forced as the third
    new token, of the 7 the source's config allows."""
    _, checkpoint, sets, _ = trained
    out = tmp_path / "chat"
    assert _export(sets, checkpoint, out) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = transformers.GenerationConfig.from_pretrained(out)
    assert (config.eos_token_id, config.pad_token_id) == (im_end, tokenizer.pad_token_id)
    assert config.max_new_tokens == 7 and im_end != tokenizer.pad_token_id
    model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(out)
    prompt = tokenizer("<|im_start|>user\ncolour?<|im_end|>\n<|im_start|>assistant\n")
    prompt = torch.tensor([prompt["input_ids"]])

    class EndOnThird(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            ending = input_ids.shape[1] == prompt.shape[1] + 2
            scores[:, im_end] = -torch.inf
            if ending:
                scores[:] = -torch.inf
                scores[:, im_end] = 0.0
            return scores

    forced = transformers.LogitsProcessorList([EndOnThird()])
    said = model.generate(prompt, logits_processor=forced, do_sample=False)
    assert said.shape[1] == prompt.shape[1] + 3 and int(said[0, -1]) == im_end, said


def test_export_experts_stacked_and_bf16_on_request(trained, tmp_path, capsys):
    from qwen35_trainer.train.export import PROCESSOR_FILES

    source, checkpoint, sets, state = trained
    out = tmp_path / "stacked"
    assert _export(sets, checkpoint, out, "--experts", "stacked", "--dtype", "bfloat16") == 0
    said = capsys.readouterr().out
    assert "weights in bfloat16, routed experts stacked" in said
    # the processor's files as the source holds them, byte for byte (not re-saved)
    held = [name for name in PROCESSOR_FILES if (source / name).is_file()]
    assert {"tokenizer.json", "preprocessor_config.json", "video_preprocessor_config.json"} <= set(
        held
    )
    for name in held:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert f"copied byte for byte from {source}: {', '.join(held)}" in said
    assert any(name.endswith(".mlp.experts.gate_up_proj") for name in _names(out))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # every file readable as the others (safetensors alone wrote owner-only 0600 files)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(modes.values()) == {oct(creation_mode())}, modes
    assert creation_mode() == 0o666 & ~_umask(), modes  # what open() gives a new file
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    assert all(torch.equal(v, state[k].to(torch.bfloat16)) for k, v in loaded.state_dict().items())


def test_export_takes_the_dtype_the_source_stores(trained, tmp_path):
    """A source stored in bf16 (``config.json``'s ``dtype``, read once into the recipe as
    ``model.stored_dtype``): the export of fp32-trained weights is bf16 without ``--dtype``."""
    source, checkpoint, sets, state = trained
    bf16 = tmp_path / "bf16_source"
    shutil.copytree(source, bf16)
    model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(source)
    model.to(torch.bfloat16).save_pretrained(bf16)
    bf16_sets = [*sets, f"model.path={bf16}"]
    assert load_recipe("tiny", bf16_sets).model.stored_dtype == "bfloat16"
    assert load_recipe("tiny", sets).model.stored_dtype == "float32"
    with pytest.raises(ValueError, match=r"model.stored_dtype: recipe 'float16', checkpoint's"):
        load_recipe("tiny", [*bf16_sets, "model.stored_dtype=float16"])
    out = tmp_path / "as_stored"
    assert _export(bf16_sets, checkpoint, out) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(out)
    assert all(torch.equal(v, state[k].to(torch.bfloat16)) for k, v in loaded.state_dict().items())


def test_train_export_dir_not_empty_is_refused_before_training(trained, tmp_path):
    _, _, sets, _ = trained
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"is not empty \(it holds keep.txt\)"):
        train(load_recipe("tiny", [*sets, "train.steps=1", f"train.export_dir={tmp_path}"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
