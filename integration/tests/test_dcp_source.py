"""A torch Distributed Checkpoint folder of model state as a weight source
(:mod:`qwen35_trainer.model.weights.dcp`), in one process: a transformers model's state dict
saved by ``torch.distributed.checkpoint.save`` builds the same model as its ``save_pretrained``
folder (config given by the recipe, or ``config.json`` beside it); this trainer's own training
checkpoint's model state builds what torch's own converter reads from it; a folder that is
neither kind, or a DCP folder that does not fit, is one error naming it. Every layout from a DCP
folder: test_train_matrix.py (``dcp`` column); a rank reads only the chunks of its rows:
source_checks.py's ``check_dcp_reads_only_its_chunks`` in that file's world-2 launch."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import tiny

from qwen35_trainer import train
from qwen35_trainer.model import build_config, build_model

NO_MTP = "model.mtp_layers=0"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A transformers model saved twice: ``save_pretrained`` (``hf``) and DCP (``dcp``, no
    config), and DCP with its ``config.json`` beside (``dcp_config``)."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    root = tmp_path_factory.mktemp("dcp_source")
    torch.manual_seed(1)
    model = Qwen3_5MoeForConditionalGeneration(build_config(tiny(NO_MTP).model))
    model.save_pretrained(root / "hf")
    dcp.save(model.state_dict(), checkpoint_id=str(root / "dcp"), no_dist=True)
    shutil.copytree(root / "dcp", root / "dcp_config")
    shutil.copy(root / "hf" / "config.json", root / "dcp_config" / "config.json")
    return root


def _state(*overrides: str) -> dict[str, torch.Tensor]:
    return build_model(tiny(NO_MTP, *overrides).model).state_dict()


def test_a_dcp_folder_builds_what_its_safetensors_twin_builds(folders):
    """The DCP folder (config by the recipe, or beside it as ``model.path``) and the
    ``save_pretrained`` folder of the same model give the same tensors, bit for bit."""
    reference = _state(f"model.path={folders / 'hf'}")
    for source in (f"model.weights={folders / 'dcp'}", f"model.path={folders / 'dcp_config'}"):
        state = _state(source)
        assert state.keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(state[name], value), (source, name)


def test_a_training_checkpoints_model_state_starts_a_run(tmp_path):
    """``model.weights`` = one of this trainer's ``step_<N>`` folders starts from its model
    state (its optimizer state and step are not weights), equal to what torch's own DCP
    converter reads from it; and a run trains from it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    recipe = ("model.mtp_layers=1", "train.steps=1", "train.checkpoint_every=1")
    train(tiny(*recipe, f"train.checkpoint_dir={tmp_path / 'run'}")).close()
    step = tmp_path / "run" / "step_000001"
    dcp_to_torch_save(step, tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)["model"]  # the objective's
    saved = {name.removeprefix("model."): value for name, value in saved.items()}
    state = build_model(tiny("model.mtp_layers=1", f"model.weights={step}").model).state_dict()
    assert state.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(state[name], value.to(state[name].dtype)), name
    with train(tiny("model.mtp_layers=1", "train.steps=1", f"model.weights={step}")) as run:
        assert torch.isfinite(torch.tensor(run.logs[0].loss))


def test_a_folder_of_neither_kind_is_one_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ValueError,
        match=r"neither a transformers checkpoint directory .*"
        r"nor a torch Distributed Checkpoint folder \(no \.metadata there\)",
    ):
        build_model(tiny(NO_MTP, f"model.weights={tmp_path / 'empty'}").model)


def test_a_damaged_or_unfitting_dcp_folder_is_one_error(folders, tmp_path):
    """A ``.metadata`` torch cannot read names the file; a DCP folder of another model names
    each tensor that does not fit."""
    damaged = tmp_path / "damaged"
    shutil.copytree(folders / "dcp", damaged)
    (damaged / ".metadata").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"\.metadata cannot be read"):
        build_model(tiny(NO_MTP, f"model.weights={damaged}").model)
    with pytest.raises(ValueError, match=r"does not fit the recipe's model .*lm_head\.weight"):
        build_model(
            tiny(NO_MTP, f"model.weights={folders / 'dcp'}", "model.text.vocab_size=300").model
        )
