"""The 397B pipeline recipe (``qwen3_5_397b_a17b_pp``: PP 30 × DP 8 with EP 8, 240 ranks) from
a checkpoint folder: ``plan`` takes the folder, and on the fake 240-rank world each planned
rank's load is planned against the whole model and reads exactly its own shards' bytes.

The folder is the published checkpoint's layout (per-expert experts, the MTP head, bf16) with
every tensor's header and no data: sparse safetensors files (``truncate``), 0.8 TB on paper and
a few MiB on disk. The ranks' reads are recorded instead of made (the files' row reader returns
meta tensors of the rows asked for), so the test proves what would be read: the first stage's
rank reads the embedding, the vision tower and its decoder layers; the last stage's rank its
layers, the final norm, ``lm_head`` and the MTP head; neither a byte of another stage's tensors;
and each exactly the bytes of its shards (FSDP and EP cut dim 0 only, so a shard's dim-0 span
is the shard).
"""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from qwen35_trainer import load_recipe
from qwen35_trainer.cli import main
from qwen35_trainer.model import build_config, build_meta_model, build_training_model
from qwen35_trainer.model.build import weight_sources
from qwen35_trainer.model.params import named_parameters
from qwen35_trainer.model.weights.adapter import on_disk
from qwen35_trainer.model.weights.files import CheckpointFiles
from qwen35_trainer.model.weights.shards import local_index, read_local
from qwen35_trainer.model.weights.sources import plan_fill
from qwen35_trainer.plan.world import fake_world

RECIPE = "qwen3_5_397b_a17b_pp"
FILES = 200  # about 4 GB each (on paper): each is mapped whole to read its header


def _headers_only(folder, recipe, drop=(), extra=()) -> dict[str, tuple[int, ...]]:
    """The recipe's model as the published checkpoint stores it, headers only (module
    docstring), without the tensors ``drop`` and with ``extra`` ones [8]; returns every on-disk
    tensor's shape."""
    model = build_meta_model(recipe.model)
    shapes = {}
    for name, *_, param in named_parameters(model):
        for disk, shape, _ in on_disk(name, tuple(param.shape), per_expert=True):
            if disk not in drop:
                shapes[disk] = shape
    shapes |= {name: (8,) for name in extra}
    names = list(shapes)
    weight_map = {}
    for i in range(FILES):
        part = names[i::FILES]
        file = f"model-{i + 1:05d}-of-{FILES:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in part:
            size = math.prod(shapes[name]) * 2
            header[name] = {"dtype": "BF16", "shape": list(shapes[name])}
            header[name]["data_offsets"] = [offset, offset + size]
            offset += size
            weight_map[name] = file
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(folder / file, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(8 + len(text) + offset)
    index = {"metadata": {"total_size": sum(math.prod(s) * 2 for s in shapes.values())}}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({**index, "weight_map": weight_map})
    )
    build_config(recipe.model).to_json_file(str(folder / "config.json"))
    return shapes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_397b")
    shapes = _headers_only(folder, load_recipe(RECIPE))
    return folder, shapes


def test_plan_takes_the_checkpoint_folder(checkpoint, capsys):
    """``plan`` of the PP recipe with ``model.path``: the folder's config, the verdict fits."""
    folder, _ = checkpoint
    assert main(["plan", RECIPE, "--set", f"model.path={folder}"]) == 0
    assert "fits" in capsys.readouterr().out


@pytest.fixture
def no_process_group():
    """No default process group: the fake world is made here (one process's world-1 group, left
    by a ``train`` earlier in this worker, is dropped first)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 239], ids=["first_stage", "last_stage"])
def test_each_stage_reads_its_own_shards_only(checkpoint, monkeypatch, no_process_group, rank):
    folder, shapes = checkpoint
    recipe = load_recipe(RECIPE, [f"model.path={folder}"])
    read: dict[str, int] = {}

    def rows(self, key, lo, hi):  # what would be read: recorded, a meta tensor of the rows
        shape = self.shape(key)
        read[key] = read.get(key, 0) + (hi - lo) * math.prod(shape[1:]) * 2
        return torch.empty((hi - lo, *shape[1:]), dtype=torch.bfloat16, device="meta")

    monkeypatch.setattr(CheckpointFiles, "rows", rows)
    with fake_world(recipe.parallel.world, rank):
        objective, _ = build_training_model(recipe, torch.device("cpu"), materialize=False)
        model = objective.model
        sources = weight_sources(model, weights=str(folder), seed=recipe.train.seed)
        readers = plan_fill(model, sources, "cpu")
        held = 0
        for name, _, _, param in named_parameters(model):
            index = local_index(param)
            block = read_local(readers[name], index)
            assert tuple(block.shape) == tuple(len(i) for i in index), name
            held += math.prod(len(i) for i in index) * 2
        plan = objective.pipeline.plan
        mine = {str(i) for s in plan.mine for i in plan.stage_layers[s]}
    layers = {k.split(".")[3] for k in read if k.startswith("model.language_model.layers.")}
    assert layers == mine
    if rank == 0:
        assert any(k.startswith("model.visual.") for k in read)
        assert "model.language_model.embed_tokens.weight" in read
        assert not any(k.startswith(("lm_head", "mtp.")) for k in read)
    else:
        assert "lm_head.weight" in read and any(k.startswith("mtp.") for k in read)
        assert not any(k.startswith(("model.visual", "model.language_model.embed")) for k in read)
    assert sum(read.values()) == held
    assert sum(read.values()) < sum(math.prod(s) * 2 for s in shapes.values()) / 200


def test_a_folder_that_does_not_fit_is_one_message_on_every_stage(tmp_path, no_process_group):
    """A tensor of the FIRST stage missing and one the model has no place for: the last
    stage's rank names both (the fit is judged on the whole model, so every rank agrees)."""
    recipe = load_recipe(RECIPE)
    missing = "model.visual.blocks.0.attn.qkv.weight"
    _headers_only(tmp_path, recipe, drop=(missing,), extra=("model.visual.unknown",))
    recipe = load_recipe(RECIPE, [f"model.path={tmp_path}"])
    with fake_world(recipe.parallel.world, 239):
        objective, _ = build_training_model(recipe, torch.device("cpu"), materialize=False)
        model = objective.model
        with pytest.raises(ValueError) as err:
            plan_fill(model, weight_sources(model, weights=str(tmp_path)), "cpu")
    said = str(err.value)
    assert f"does not fit the recipe's model (2 tensor(s)): {missing}: missing" in said, said
    assert "model.visual.unknown: on disk, not in the model" in said, said
