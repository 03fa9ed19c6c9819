"""Every parallel layout takes the same steps as one process (gloo, world 2 and 4).

The reference runs here, in one process, on the global batch (``dp=1`` with all the rows);
each rank of a launch trains its share under a layout and compares with it, one launch per
world size for this file's layouts (the compiled ones: test_train_compiled.py; every layout from
every weight source: test_train_matrix.py). At world 4 each rank holds one row and the smallest parameters
leave some ranks with empty local shards. Layouts: FSDP2 data parallelism; EP 2 (experts split
over pairs of ranks, dense parameters over all, experts FSDP-sharded over the rest); EP = world
with activation checkpointing of decoder and vision blocks and packed rows (the reference is
right-padded); CP = world (one packed row split over every rank by its balanced document
layout) with activation checkpointing; DP x CP 2 with the experts split over the CP ranks;
DP x TP 2 (attention heads and shared expert split) on packed rows. Every TP layout runs with
sequence parallelism (the default with tp > 1: TP 2, DP 2 x TP 2 with checkpointing, TP 2 x CP 2,
DP 2 x TP 2 x EP 2 with accumulation, bf16 TP 2) except TP 2 x EP 2, which keeps the replicated
residual stream (``parallel.sequence_parallel=false``). The packed layouts with TP,
EP = world, CP 2 x EP 2 and bf16 also train the multi-token-prediction head, against one packed
process with it (the token after a CP rank's last position lives on the other rank). Resume: a run stopped after one
step (DCP checkpoint, written synchronously or in the background) and started again continues
exactly, under the same layout and in one process; with the newest checkpoint damaged in one
rank's file, every rank falls back to the one before it. megatron-fsdp
(``parallel.fsdp_backend=megatron``, the real package on these CPU ranks under
``dist_testkit.cpu_cuda_streams``): DP 2 with accumulation, evaluation and export, bf16 (also
resumed), HSDP (2 replicas x CP 2)
with accumulation (also resumed); a checkpoint written on megatron-fsdp resumes on FSDP2 and the
other way round.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from dist_checks import (
    assert_same_run,
    check_checkpoints_cross_backends,
    check_resume_equals_uninterrupted,
    check_resume_skips_a_damaged_checkpoint,
    check_runs_repeat,
    layout_recipe,
)
from layout_launch import (
    COMPARE,
    LAYOUTS,
    VARIANTS,
    layout_checks,
    one_process_references,
    write_fp8_base,
)
from pp_checks import (
    check_padding_not_computed,
    pp_export_equals_one_process,
    pp_resume_in_one_process,
)
from pp_layouts import PP_EXPORTED, PP_RESUMED
from resource_checks import check_runs_release_what_they_create
from train_layouts import COMPILED, REPEATS, RESUMED, RESUMED_AT_2

from dist_testkit import named_check, run_checks
from qwen35_trainer import train

# this file's layouts: every one but the compiled ones (test_train_compiled.py)
HERE = [name for name in LAYOUTS if name not in COMPILED]


@pytest.fixture(scope="module")
def fp8_base(tmp_path_factory):
    return write_fp8_base(tmp_path_factory.mktemp("fp8_base"))


@pytest.fixture(scope="module")
def references(fp8_base):
    """The one-process run of each variant this file's layouts and checks compare with."""
    return one_process_references(
        [LAYOUTS[name][1] for name in HERE] + ["base", "lora_mtp", "pp_mtp"], fp8_base
    )


@pytest.fixture(scope="module")
def one_process_pp_checkpoint(tmp_path_factory):
    """The one-process run of the ``pp_mtp`` variant stopped after step 1: its checkpoint
    folder (a PP run resumes from it)."""
    folder = tmp_path_factory.mktemp("one_process_pp")
    with train(
        layout_recipe(1, *VARIANTS["pp_mtp"], f"train.checkpoint_dir={folder}", "train.steps=1")
    ):
        pass
    return folder


@pytest.fixture(scope="module")
def reference(references):
    return references["base"]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def launch(request, references, fp8_base, one_process_pp_checkpoint, tmp_path_factory):
    world = request.param
    exported = tmp_path_factory.mktemp(f"export_world{world}")
    megatron_exported = tmp_path_factory.mktemp(f"megatron_export_world{world}")
    fill = {
        "world": world,
        "half": world // 2,
        "rows": 8 // world,
        "export": exported,
        "megatron_export": megatron_exported,
        "ac": str(world == 4).lower(),
        "fp8": fp8_base,
    }
    resume_dirs = {
        name: str(tmp_path_factory.mktemp(f"{name}_world{world}"))
        for name in RESUMED | PP_RESUMED
        if world in LAYOUTS[name][2]
    }
    folders = {
        name: [
            *([resume_dirs[name]] if name in resume_dirs else []),
            *([str(one_process_pp_checkpoint)] if name in PP_RESUMED else []),
            *([str(tmp_path_factory.mktemp(name))] if name in PP_EXPORTED else []),
        ]
        for name in HERE
    }
    checks = layout_checks(HERE, world, fill, references, folders)
    if world == 2:  # a stage's layers run the rows' tokens, not the buffers' padding
        checks["pp_padding"] = named_check(
            "pp_padding@2",
            check_padding_not_computed,
            tuple(o.format(**fill) for o in LAYOUTS["pp2_1f1b_ac"][0]),
        )
        checks["runs_release"] = named_check(
            "runs_release@2",
            check_runs_release_what_they_create,
            str(tmp_path_factory.mktemp("runs_release")),
            "parallel.ep=2",
        )
        checks["cross_backend_resume"] = named_check(
            "cross_backend_resume@2",
            check_checkpoints_cross_backends,
            str(tmp_path_factory.mktemp("cross_backend")),
            *references["base"],
        )
    saved = tmp_path_factory.mktemp(f"ckpt_world{world}")
    checks["resume"] = named_check(
        f"resume@{world}",
        check_resume_equals_uninterrupted,
        ("parallel.ep=2",),
        str(saved),
        *references["base"],
    )
    checks["resume_async"] = named_check(
        f"resume_async@{world}",
        check_resume_equals_uninterrupted,
        ("parallel.ep=2", "train.async_checkpoint=true"),
        str(tmp_path_factory.mktemp(f"async_ckpt_world{world}")),
        *references["base"],
    )
    checks["resume_damaged"] = named_check(
        f"resume_damaged@{world}",
        check_resume_skips_a_damaged_checkpoint,
        ("parallel.ep=2",),
        str(tmp_path_factory.mktemp(f"damaged_ckpt_world{world}")),
        *references["base"],
    )
    if world == 4:  # a LoRA run stopped and resumed from its adapter checkpoint
        checks["resume_lora"] = named_check(
            "resume_lora@4",
            check_resume_equals_uninterrupted,
            LAYOUTS["lora_dp2_cp2_ep2"][0],
            str(tmp_path_factory.mktemp("lora_ckpt")),
            *references["lora_mtp"],
            COMPARE["lora_mtp"],
        )
    for name, overrides in REPEATS.items():
        if world == 4:  # the tiny recipe's own 4 ranks
            checks[name] = named_check(
                name, check_runs_repeat, str(tmp_path_factory.mktemp(name)), overrides
            )
    report = run_checks(list(checks.values()), world, timeout=900)
    return checks, report, saved, (exported, megatron_exported), resume_dirs


@pytest.mark.parametrize(
    "layout",
    [
        *HERE,
        "resume",
        "resume_async",
        "resume_damaged",
        "resume_lora",
        "cross_backend_resume",
        "pp_padding",
        "runs_release",
        *REPEATS,
    ],
)
def test_layout_equals_one_process(launch, layout):
    checks, report, *_ = launch
    if layout not in checks:
        worlds = LAYOUTS[layout][2] if layout in LAYOUTS else (2 if layout in RESUMED_AT_2 else 4)
        pytest.skip(f"{layout} runs at world {worlds}")
    report.assert_passed(checks[layout])


def test_checkpoint_of_a_pipeline_run_resumes_in_one_process(
    launch, references, one_process_pp_checkpoint, tmp_path
):
    """The step-1 checkpoint written by the PP 2 ranks (each its stages' parameters and Adam
    state), resumed by ONE process (read by name): steps 2..3 and the final parameters equal
    the uninterrupted run; its export equals the export of one process's step-1 checkpoint."""
    checks, report, *_, resume_dirs = launch
    if "pp2_1f1b_ac" not in checks:
        pytest.skip("the PP 2 run is at world 2")
    report.assert_passed(checks["pp2_1f1b_ac"])
    saved = Path(resume_dirs["pp2_1f1b_ac"])
    pp_resume_in_one_process(saved, tmp_path / "resumed", VARIANTS["pp_mtp"], references["pp_mtp"])
    pp_export_equals_one_process(
        saved, one_process_pp_checkpoint, tmp_path / "exports", VARIANTS["pp_mtp"]
    )


def test_checkpoint_of_a_sharded_run_resumes_in_one_process(launch, reference, tmp_path):
    """The step-1 checkpoint written by the EP 2 + FSDP2 ranks, resumed by ONE process (DCP
    re-shards on load): steps 2..3 and the final parameters equal the uninterrupted run."""
    checks, report, saved, *_ = launch
    report.assert_passed(checks["resume"])
    shutil.copytree(saved / "step_000001", tmp_path / "step_000001")
    result = train(layout_recipe(1, f"train.checkpoint_dir={tmp_path}"))
    state = result.objective.model.state_dict()
    assert_same_run(result.logs, reference[0][1:], state, reference[1])


@pytest.mark.parametrize("layout", ["ep2", "megatron_fsdp_accum"])
def test_export_of_a_sharded_run_loads_in_transformers(launch, references, layout):
    """The EP 2 + FSDP2 layout and the megatron-fsdp one exported their trained model (each
    rank gathering the tensors it writes): transformers' own class loads it, and the weights
    are those of the one-process run of the same recipe."""
    if layout not in launch[0]:
        pytest.skip(f"{layout} runs at world {LAYOUTS[layout][2]}")
    reference = references[LAYOUTS[layout][1]]
    checks, report, _, (fsdp2_export, megatron_export), _ = launch
    report.assert_passed(checks[layout])
    exported = megatron_export if layout.startswith("megatron") else fsdp2_export
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(exported)
    state = loaded.state_dict()
    lr = layout_recipe(1).train.lr
    for name, value in reference[1].items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-3 * lr)
