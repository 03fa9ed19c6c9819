"""The FP8 base is held as the checkpoint stores it: the modules in FP8 are exactly those the
files hold in float8 — a checkpoint that keeps its MTP layers in bf16 (``modules_to_not_convert``,
as third-party FP8 checkpoints do) trains them in bf16, bit for bit as stored — while a bf16
checkpoint quantized on load keeps Qwen's release rule; ``model.fp8_block`` against an FP8
checkpoint's blocks is one error naming both; the run's first lines state the FP8 modules by kind
and the bytes the base holds."""

from __future__ import annotations

import pytest
import torch
from fp8_fixtures import export_base, fp8_checkpoint
from helpers import tiny
from safetensors.torch import load_file

from qwen35_trainer import build_model
from qwen35_trainer.model.kernels import resolve_kernels
from qwen35_trainer.supervise.console import what_runs

BLOCK = (12, 12)
LORA = "model.lora={rank: 4, alpha: 8, expert_rank: 8}"
PACKED = ("data.packing=true", "model.mtp_layers=1")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``(bf16 base, FP8 with every release projection, FP8 keeping the MTP layers in bf16)``."""
    root = tmp_path_factory.mktemp("fp8_as_stored")
    base = export_base(root / "base")
    return (
        base,
        fp8_checkpoint(root / "fp8", base, BLOCK),
        fp8_checkpoint(root / "fp8_mtp_bf16", base, BLOCK, keep=("mtp.layers.",)),
    )


def _fp8_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}


def _disk(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_the_modules_in_fp8_are_those_the_checkpoint_stores_in_float8(folders):
    base, fp8, kept = folders
    everything = _fp8_names(build_model(tiny(f"model.path={fp8}", *PACKED, LORA).model))
    model = build_model(tiny(f"model.path={kept}", *PACKED, LORA).model)
    partial = _fp8_names(model)
    mtp = {n for n in everything if n.startswith("mtp.layers.")}
    assert mtp and partial == everything - mtp  # the MTP layers' projections not in FP8
    disk, params = _disk(kept), dict(model.named_parameters())
    for name in (
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.mlp.shared_expert.up_proj.weight",
    ):
        assert disk[name].dtype == torch.bfloat16
        assert torch.equal(params[name].to(torch.bfloat16), disk[name]), name  # as stored
    # a bf16 checkpoint quantized on load: the release rule, the MTP layers included
    quantized = build_model(tiny(f"model.path={base}", *PACKED, LORA, "model.base_dtype=fp8").model)
    assert _fp8_names(quantized) == everything


def test_a_block_size_against_the_checkpoints_is_one_error(folders):
    _, fp8, _ = folders
    with pytest.raises(ValueError) as err:
        tiny(f"model.path={fp8}", *PACKED, LORA, "model.fp8_block=[128, 128]")
    assert "model.fp8_block [128, 128] disagrees with the FP8 checkpoint's blocks" in str(err.value)
    assert "weight_block_size [12, 12]" in str(err.value)
    assert tiny(f"model.path={fp8}", *PACKED, LORA, "model.fp8_block=[12, 12]").model.block == BLOCK


def test_the_run_states_the_fp8_modules_and_bytes(folders):
    _, fp8, kept = folders
    for folder, mtp in ((fp8, True), (kept, False)):
        recipe = tiny(f"model.path={folder}", *PACKED, LORA)
        model = build_model(recipe.model)
        lines = "\n".join(
            what_runs(recipe, 1, torch.device("cpu"), resolve_kernels(recipe, "cpu"), model)
        )
        assert "FP8 modules: " in lines and "4 attention projections" in lines, lines
        assert ("MTP-head attention projections" in lines) is mtp, lines
        held = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
        assert f"the base holds {held / 2**20:.3g} MiB in float8" in lines, lines
        assert "LoRA adapters on" in lines and "trained in full: none" in lines, lines


def test_the_plan_states_the_fp8_modules_and_bytes(folders, capsys):
    from qwen35_trainer.cli import main

    _, _, kept = folders
    sets = [f"model.path={kept}", *PACKED, LORA, "parallel.dp=1", "parallel.cp=1", "parallel.ep=1"]
    assert main(["plan", "tiny", *(a for s in sets for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert "FP8 modules: " in out and "4 attention projections" in out, out
    assert "MTP-head" not in out, out  # the checkpoint keeps its MTP layers in bf16
