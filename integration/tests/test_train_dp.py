"""Every parallel layout takes the same steps as one process (gloo, world 2 and 4).

The reference runs here, in one process, on the global batch (``dp=1`` with all the rows);
each rank of a launch trains its share under a layout and compares with it, one launch per
world size for all layouts. At world 4 each rank holds one row and the smallest parameters
leave some ranks with empty local shards. Layouts: FSDP2 data parallelism; EP 2 (experts split
over pairs of ranks, dense parameters over all, experts FSDP-sharded over the rest); EP = world
with activation checkpointing of decoder and vision blocks and packed rows (the reference is
right-padded); CP = world (one packed row split over every rank by its balanced document
layout) with activation checkpointing; DP x CP 2 with the experts split over the CP ranks;
DP x TP 2 (attention heads and shared expert split) on packed rows. Resume: a run stopped after one
step (DCP checkpoint) and started again continues exactly, under the same layout and in one
process.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from dist_checks import (
    STEPS,
    assert_same_run,
    check_resume_equals_uninterrupted,
    check_training_equals_one_process,
    layout_recipe,
)

from dist_testkit import named_check, run_checks
from qwen35_trainer import train

LAYOUTS = {
    "fsdp": (),
    "ep2": ("parallel.ep=2", "train.export_dir={export}"),
    "ep_all_ac_packed": (
        "parallel.ep={world}",
        "train.activation_checkpointing=true",
        "data.packing=true",
    ),
    "cp_all_ac": (
        "parallel.dp=1",
        "parallel.cp={world}",
        "data.samples_per_rank=4",
        "data.packing=true",
        "train.activation_checkpointing=true",
    ),
    "dp_x_tp2_packed": (
        "parallel.dp={half}",
        "parallel.tp=2",
        "data.samples_per_rank={rows}",
        "data.packing=true",
    ),
    "dp_x_cp2_ep2": (
        "parallel.dp={half}",
        "parallel.cp=2",
        "parallel.ep=2",
        "data.samples_per_rank={rows}",
        "data.packing=true",
    ),
}


@pytest.fixture(scope="module")
def reference():
    result = train(layout_recipe(1))
    state = {k: v.detach().clone() for k, v in result.objective.model.state_dict().items()}
    assert len(result.logs) == STEPS and result.logs[-1].loss < result.logs[0].loss
    return result.logs, state


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def launch(request, reference, tmp_path_factory):
    world = request.param
    exported = tmp_path_factory.mktemp(f"export_world{world}")
    fill = {"world": world, "half": world // 2, "rows": 8 // world, "export": exported}
    checks = {
        name: named_check(
            f"{name}@{world}",
            check_training_equals_one_process,
            tuple(o.format(**fill) for o in overrides),
            *reference,
        )
        for name, overrides in LAYOUTS.items()
    }
    saved = tmp_path_factory.mktemp(f"ckpt_world{world}")
    checks["resume"] = named_check(
        f"resume@{world}",
        check_resume_equals_uninterrupted,
        ("parallel.ep=2",),
        str(saved),
        *reference,
    )
    return checks, run_checks(list(checks.values()), world, timeout=300), saved, exported


@pytest.mark.parametrize("layout", [*LAYOUTS, "resume"])
def test_layout_equals_one_process(launch, layout):
    checks, report, _, _ = launch
    report.assert_passed(checks[layout])


def test_checkpoint_of_a_sharded_run_resumes_in_one_process(launch, reference, tmp_path):
    """The step-1 checkpoint written by the EP 2 + FSDP2 ranks, resumed by ONE process (DCP
    re-shards on load): steps 2..3 and the final parameters equal the uninterrupted run."""
    checks, report, saved, _ = launch
    report.assert_passed(checks["resume"])
    shutil.copytree(saved / "step_000001", tmp_path / "step_000001")
    result = train(layout_recipe(1, f"train.checkpoint_dir={tmp_path}"))
    state = result.objective.model.state_dict()
    assert_same_run(result.logs, reference[0][1:], state, reference[1])


def test_export_of_a_sharded_run_loads_in_transformers(launch, reference):
    """The EP 2 + FSDP2 layout exported its trained model (gathered, written by rank 0):
    transformers' own class loads it, and the weights are the one-process run's."""
    checks, report, _, exported = launch
    report.assert_passed(checks["ep2"])
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(exported)
    state = loaded.state_dict()
    lr = layout_recipe(1).train.lr
    for name, value in reference[1].items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-3 * lr)
