"""Meta-device build, materialisation and HF checkpoints straight into shards (gloo, world 4).

The one-process weights are the reference: the name-seeded initialisation of
:func:`qwen35_trainer.build_model`, and the tensors of a transformers checkpoint in both on-disk
expert layouts (per expert, as ``save_pretrained`` writes it, with extra ``mtp.*`` tensors that
are skipped; stacked, as our sharded export writes it). Each layout builds the model on meta,
parallelises it, materialises only its shards, and every reassembled parameter must equal the
reference bit for bit. The training runs of test_train_dp.py start from these same meta builds,
so their per-step losses against one process cover the steps.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from dist_checks import (
    check_materialized_weights,
    check_megatron_materialized_weights,
    check_training_equals_one_process,
    layout_recipe,
)
from helpers import TINY
from safetensors.torch import save_file

from dist_testkit import launch as launch_ranks
from dist_testkit import named_check, run_checks
from qwen35_trainer import build_config, build_model, export_hf, load_recipe, train

LAYOUTS = {
    "ep2_fsdp": ("parallel.dp=4", "parallel.ep=2"),
    "cp2_ep2": ("parallel.dp=2", "parallel.cp=2", "parallel.ep=2", "data.packing=true"),
    "tp2": ("parallel.dp=2", "parallel.tp=2", "data.packing=true"),
    "tp2_ep2_bf16": (
        "parallel.dp=2",
        "parallel.tp=2",
        "parallel.ep=2",
        "data.packing=true",
        "train.dtype=bfloat16",
    ),
    "hsdp_ep2": ("parallel.dp_replicate=2", "parallel.dp=2", "parallel.ep=2"),
    # parallel.fsdp_backend=megatron: megatron-fsdp materialises it unit by unit; in bf16 its
    # fp32 main weights (what is compared) start from the fp32 values
    "megatron_dp4": ("parallel.dp=4",),
    "megatron_bf16_dp4": ("parallel.dp=4", "train.dtype=bfloat16"),
}


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    """Source -> the one-process state dict: None (init) and two checkpoint directories."""
    r = layout_recipe(1)
    per_expert = tmp_path_factory.mktemp("per_expert")
    torch.manual_seed(7)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(build_config(r.model))
    hf.save_pretrained(per_expert)
    mtp = {"mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.ones(2, 2)}
    save_file(mtp, str(per_expert / "model-mtp.safetensors"))
    stacked = tmp_path_factory.mktemp("stacked")
    export_hf(hf, stacked, max_file_bytes=1 << 16)  # several files, experts stacked
    return {
        None: _state(build_model(r.model, seed=r.train.seed)),
        str(per_expert): _state(hf),
        str(stacked): _state(hf),
    }


# layouts that also train STEPS steps from the per-expert checkpoint against one process
TRAINED_FROM_CHECKPOINT = ("cp2_ep2", "tp2")


@pytest.fixture(scope="module")
def from_checkpoint(expected):
    """The one-process run from the per-expert checkpoint: its step logs and final weights."""
    per_expert = next(p for p in expected if p is not None)
    result = train(layout_recipe(1, f"model.weights={per_expert}", "data.packing=true"))
    return per_expert, result.logs, _state(result.objective.model)


@pytest.fixture(scope="module")
def launch(expected, from_checkpoint):
    checks = {
        name: named_check(
            name,
            check_megatron_materialized_weights
            if name.startswith("megatron")
            else check_materialized_weights,
            overrides,
            expected,
        )
        for name, overrides in LAYOUTS.items()
    }
    weights, logs, state = from_checkpoint
    for name in TRAINED_FROM_CHECKPOINT:
        checks[f"{name}_trained"] = named_check(
            f"{name}_trained",
            check_training_equals_one_process,
            # the global batch of one process: each of the 2 data groups takes 2 rows
            (*LAYOUTS[name], "data.samples_per_rank=2", f"model.weights={weights}"),
            logs,
            state,
        )
    return checks, run_checks(list(checks.values()), 4, timeout=600)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_meta_build_materialises_the_one_process_weights(launch, layout):
    checks, report = launch
    report.assert_passed(checks[layout])


@pytest.mark.parametrize("layout", TRAINED_FROM_CHECKPOINT)
def test_a_layout_started_from_a_checkpoint_trains_as_one_process(launch, layout):
    """Per step loss, CE, aux and gradient norm, then the final weights, against one process
    started from the same transformers checkpoint."""
    checks, report = launch
    report.assert_passed(checks[f"{layout}_trained"])


def test_the_checkpoints_hold_both_expert_layouts(expected):
    """Guards the fixture: one directory per expert layout, so both readers are exercised."""
    from qwen35_trainer.model.weights.files import CheckpointFiles

    per_expert, stacked = (CheckpointFiles(p).where for p in expected if p is not None)
    assert any(k.endswith("experts.0.gate_proj.weight") for k in per_expert)
    assert not any(k.endswith("experts.gate_up_proj") for k in per_expert)
    assert any(k.endswith("experts.gate_up_proj") for k in stacked)
    assert any(k.startswith("mtp.") for k in per_expert)


# a tiny model made wide enough that its weights (about 140 MB) dwarf the allocator's noise
WIDE = (
    "model.text.hidden_size=256",
    "model.vision.out_hidden_size=256",
    "model.text.num_experts=32",
    "model.text.moe_intermediate_size=256",
    "model.text.vocab_size=4096",
)
WINDOW = 4 << 20


def _load_peak(overrides, weights, window):
    from dist_checks import load_peak_rss

    return load_peak_rss(overrides, weights, window)


def test_loading_holds_the_shards_plus_one_slice(tmp_path):
    """Peak RSS of each rank while a checkpoint is read into its EP 2 + FSDP shards (world 2):
    at most its shards + the mapped window + its largest local slice + 4 MiB (measured here:
    57 MiB for 54 MiB of shards of a 107 MiB model; reading each whole tensor and slicing it
    peaks at 78-86 MiB and fails)."""
    overrides = ("parallel.dp=2", "parallel.cp=1", "parallel.ep=2", *WIDE)
    export_hf(build_model(load_recipe(TINY, overrides).model), tmp_path)
    outcomes = launch_ranks(
        _load_peak,
        2,
        overrides,
        str(tmp_path),
        WINDOW,
        timeout=300,
        env={"MALLOC_MMAP_THRESHOLD_": "131072"},
    )
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    for o in outcomes:
        got = o.value
        bound = got["shards"] + WINDOW + got["largest_slice"] + (4 << 20)
        assert got["increase"] <= bound, got
        assert got["shards"] > 50e6, got  # the weights are what is measured
