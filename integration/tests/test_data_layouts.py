"""Training on a conversation dataset: every layout takes the same steps as one process (gloo,
world 2), a resumed DP 2 run continues exactly, and a bad row, or a non-finite step, on one
rank stops every rank with a message instead of a hang.

The reference runs here, in one process, on the demo dataset (4 packed rows per step); the
loader gives every layout the same global step (:mod:`qwen35_trainer.data.loader`), so a
layout's logs and final parameters must equal the reference's. CP 2 splits each packed row over
both ranks, its images' and videos' frames encoded by the rank that holds them (cp-vision).
"""

from __future__ import annotations

import pytest
from dist_checks import (
    DATASET,
    FIELDS,
    check_bad_row_raises_on_every_rank,
    check_dataset_layout_equals_one_process,
    check_dataset_resume,
    check_nonfinite_stops_every_rank,
)
from helpers import demo_recipe, media_document

from dist_testkit import named_check, run_checks
from qwen35_trainer import train
from qwen35_trainer.demo.dataset import make_demo

LAYOUTS = {
    "dp2": ("parallel.dp=2",),
    "cp2_ac": ("parallel.cp=2", "train.activation_checkpointing=true"),
    "dp2_ep2": ("parallel.dp=2", "parallel.ep=2"),
    "cp2_ep2_accum": (
        "parallel.cp=2",
        "parallel.ep=2",
        "train.grad_accum_steps=2",
        "train.router_aux_loss_coef=0",
    ),
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    root = make_demo(tmp_path_factory.mktemp("demo"), train_rows=48, heldout_rows=8)
    references = {}
    for aux in ((), ("train.router_aux_loss_coef=0",)):
        result = train(demo_recipe(root, *DATASET, *aux))
        assert result.logs[-1].loss < result.logs[0].loss
        references[aux] = (
            result.logs,
            result.state_dict(),
        )
    checks = {
        name: named_check(
            name,
            check_dataset_layout_equals_one_process,
            str(root),
            overrides,
            *references[tuple(o for o in overrides if "aux" in o)],
            ("loss", "ce", "grad_norm") if "accum" in name else FIELDS,
        )
        for name, overrides in LAYOUTS.items()
    }
    checks["resume_dp2"] = named_check(
        "resume_dp2",
        check_dataset_resume,
        str(root),
        str(tmp_path_factory.mktemp("ckpt")),
        *references[()],
    )
    checks["bad_row"] = named_check("bad_row", check_bad_row_raises_on_every_rank, str(root))
    rank_1 = media_document(demo_recipe(root, *DATASET), step=3, rows=range(2, 4))
    checks["nonfinite"] = named_check(
        "nonfinite", check_nonfinite_stops_every_rank, str(root), rank_1
    )
    return checks, run_checks(list(checks.values()), 2, timeout=600)


@pytest.mark.parametrize("check", [*LAYOUTS, "resume_dp2", "bad_row", "nonfinite"])
def test_dataset_layouts(launch, check):
    checks, report = launch
    report.assert_passed(checks[check])
