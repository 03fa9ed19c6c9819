"""Every parallel layout takes the same steps as one process (gloo, world 2 and 4).

The reference runs here, in one process, on the global batch (``dp=1`` with all the rows);
each rank of a launch trains its share under a layout and compares with it, one launch per
world size for all layouts. At world 4 each rank holds one row and the smallest parameters
leave some ranks with empty local shards. Layouts: FSDP2 data parallelism; EP 2 (experts split
over pairs of ranks, dense parameters over all, experts FSDP-sharded over the rest); EP = world
with activation checkpointing of decoder and vision blocks and packed rows (the reference is
right-padded); CP = world (one packed row split over every rank by its balanced document
layout) with activation checkpointing; DP x CP 2 with the experts split over the CP ranks;
DP x TP 2 (attention heads and shared expert split) on packed rows. Every TP layout runs with
sequence parallelism (the default with tp > 1: TP 2, DP 2 x TP 2 with checkpointing, TP 2 x CP 2,
DP 2 x TP 2 x EP 2 with accumulation, bf16 TP 2) except TP 2 x EP 2, which keeps the replicated
residual stream (``parallel.sequence_parallel=false``). DP 2 x CP 2 x EP 2 and TP 2 also run with every
block compiled (``train.compile``, with checkpointing); TP 2 also with async TP
(``parallel.async_tp``: Inductor's micro-pipeline TP pass fusing the blocks' collectives into
their matmuls on these CPU ranks, ``dist_testkit.cpu_micro_pipeline_tp``). The packed layouts with TP,
EP = world, CP 2 x EP 2 and bf16 also train the multi-token-prediction head, against one packed
process with it (the token after a CP rank's last position lives on the other rank). Resume: a run stopped after one
step (DCP checkpoint, written synchronously or in the background) and started again continues
exactly, under the same layout and in one process; with the newest checkpoint damaged in one
rank's file, every rank falls back to the one before it. megatron-fsdp
(``parallel.fsdp_backend=megatron``, the real package on these CPU ranks under
``dist_testkit.cpu_cuda_streams``): DP 2 with accumulation, evaluation and export, CP 2 with
checkpointing, compiled blocks and the MTP head, bf16 (also resumed), HSDP (2 replicas x CP 2)
with accumulation (also resumed); a checkpoint written on megatron-fsdp resumes on FSDP2 and the
other way round.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pp_layouts
import pytest
import torch
import train_layouts
import transformers
from dist_checks import (
    STEPS,
    assert_same_run,
    check_async_tp_equals_one_process,
    check_checkpoints_cross_backends,
    check_megatron_equals_one_process,
    check_resume_equals_uninterrupted,
    check_resume_skips_a_damaged_checkpoint,
    check_runs_repeat,
    check_training_equals_one_process,
    layout_recipe,
)
from fp8_dist_checks import check_fp8_equals_one_process
from fp8_fixtures import export_base, fp8_checkpoint
from pp_checks import (
    check_padding_not_computed,
    check_pipeline_equals_one_process,
    check_pipeline_eval_and_export,
    pp_export_equals_one_process,
    pp_resume_in_one_process,
)
from pp_layouts import PP_EXPORTED, PP_RESUMED
from resource_checks import check_runs_release_what_they_create
from source_checks import check_from_source, matrix_folders, matrix_references
from source_matrix import MATRIX_LAYOUTS, MATRIX_SOURCES, REFUSED, ROWS, cells
from train_layouts import REPEATS, RESUMED, RESUMED_AT_2

from dist_testkit import named_check, run_checks
from qwen35_trainer import train

# the layout tables, each launch running all of them at its world size
LAYOUTS = {**train_layouts.LAYOUTS, **pp_layouts.PP_LAYOUTS}
VARIANTS = {**train_layouts.VARIANTS, **pp_layouts.PP_VARIANTS}
COMPARE = {**train_layouts.COMPARE, **pp_layouts.PP_COMPARE}


def _check_of(layout: str):
    """The rank-side check of ``layout``: the megatron-fsdp and async-TP layouts' own, else
    the plain comparison with one process."""
    if layout.startswith("megatron"):
        return check_megatron_equals_one_process
    if layout.startswith("async_tp"):
        return check_async_tp_equals_one_process
    if "fp8" in layout:
        return check_fp8_equals_one_process
    if layout in PP_EXPORTED:
        return check_pipeline_eval_and_export
    if layout.startswith("pp"):
        return check_pipeline_equals_one_process
    return check_training_equals_one_process


@pytest.fixture(scope="module")
def fp8_base(tmp_path_factory):
    """A tiny checkpoint in Qwen's FP8 format (:func:`fp8_fixtures.fp8_checkpoint`)."""
    root = tmp_path_factory.mktemp("fp8_base")
    return fp8_checkpoint(root / "fp8", export_base(root / "bf16"))


@pytest.fixture(scope="module")
def references(fp8_base):
    """The one-process run of each variant: its step logs and final (fp32) parameters."""
    out = {}
    for name, overrides in VARIANTS.items():
        result = train(layout_recipe(1, *(o.format(fp8=fp8_base) for o in overrides)))
        # one-process bf16 runs FSDP2 on a one-rank group: its DTensors' local part is whole
        state = {k: v.detach().float().clone() for k, v in result.state_dict().items()}
        assert len(result.logs) == STEPS and result.logs[-1].loss < result.logs[0].loss
        out[name] = (result.logs, state)
    return out


@pytest.fixture(scope="module")
def one_process_pp_checkpoint(tmp_path_factory):
    """The one-process run of the ``pp_mtp`` variant stopped after step 1: its checkpoint
    folder (a PP run resumes from it)."""
    folder = tmp_path_factory.mktemp("one_process_pp")
    train(layout_recipe(1, *VARIANTS["pp_mtp"], f"train.checkpoint_dir={folder}", "train.steps=1"))
    return folder


@pytest.fixture(scope="module")
def reference(references):
    return references["base"]


@pytest.fixture(scope="module")
def matrix(fp8_base, tmp_path_factory):
    """The source matrix's folders (source_matrix.py) and the one-process run from each."""
    root = tmp_path_factory.mktemp("matrix")
    folders = matrix_folders(root, fp8_base)
    return folders, matrix_references(folders, root)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def launch(request, references, matrix, fp8_base, one_process_pp_checkpoint, tmp_path_factory):
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
    checks = {
        name: named_check(
            f"{name}@{world}",
            _check_of(name),
            tuple(o.format(**fill) for o in overrides),
            *references[variant],
            COMPARE.get(variant),
            *([resume_dirs[name]] if name in resume_dirs else []),
            *([str(one_process_pp_checkpoint)] if name in PP_RESUMED else []),
            *([str(tmp_path_factory.mktemp(name))] if name in PP_EXPORTED else []),
        )
        for name, (overrides, variant, worlds) in LAYOUTS.items()
        if world in worlds
    }
    folders, matrix_refs = matrix
    for layout, source in cells(world):
        micro = MATRIX_LAYOUTS[layout][1]
        checks[f"{layout}/{source}"] = named_check(
            f"{layout}/{source}@{world}",
            check_from_source,
            layout,
            source,
            folders,
            matrix_refs[source, micro],
            str(tmp_path_factory.mktemp(f"{layout}_{source}")),
        )
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
    report = run_checks(list(checks.values()), world, timeout=1200)
    return checks, report, saved, (exported, megatron_exported), resume_dirs


@pytest.mark.parametrize(
    "layout",
    [
        *LAYOUTS,
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


@pytest.mark.parametrize("source", list(MATRIX_SOURCES))
@pytest.mark.parametrize("layout", list(MATRIX_LAYOUTS))
def test_layout_from_each_source_equals_one_process(launch, matrix, layout, source):
    """source_matrix.py: each layout started from each folder a user brings equals one
    process from that folder; a refused pair is refused before any rank starts, with its
    reason."""
    checks, report, *_ = launch
    if (layout, source) in REFUSED:
        _assert_refused(layout, source, matrix[0])
        return
    if f"{layout}/{source}" not in checks:
        pytest.skip(f"{layout} runs at world {MATRIX_LAYOUTS[layout][2]}")
    report.assert_passed(checks[f"{layout}/{source}"])


def test_the_export_folder_trains_as_the_seeded_model(matrix):
    """The matrix's ``export`` folder holds the seeded weights (fp32, stacked experts, sharded
    with an index): one process started from it takes the seeded run's steps exactly."""
    logs, state = matrix[1]["export", 1]
    seeded = train(layout_recipe(1, *ROWS, "model.mtp_layers=1"))
    for ours, theirs in zip(logs, seeded.logs, strict=True):
        assert (ours.loss, ours.grad_norm, ours.mtp_loss) == (
            theirs.loss,
            theirs.grad_norm,
            theirs.mtp_loss,
        )
    for name, value in seeded.state_dict().items():
        assert torch.equal(state[name], value.float()), name


def _assert_refused(layout: str, source: str, folders: dict) -> None:
    """The layout checks every launch makes before any worker starts refuse the pair with
    its reason (source_matrix.REFUSED)."""
    from source_checks import source_overrides

    from qwen35_trainer.model import build_config
    from qwen35_trainer.parallel.layout_checks import validate_layout

    overrides, micro, (world, *_) = MATRIX_LAYOUTS[layout]
    recipe = layout_recipe(world, *source_overrides(source, folders, micro), *overrides)
    with pytest.raises(ValueError, match="invalid parallel layout") as err:
        validate_layout(recipe, world, config=build_config(recipe.model), on_this_machine=False)
    assert REFUSED[layout, source] in str(err.value)


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
