"""Every parallel layout takes the same steps as one process (gloo, world 2 and 4).

The reference runs here, in one process, on the global batch (``dp=1`` with all the rows);
each rank of a launch trains its share under a layout and compares with it, one launch per
world size for all layouts. At world 4 each rank holds one row and the smallest parameters
leave some ranks with empty local shards. Layouts: FSDP2 data parallelism; EP 2 (experts split
over pairs of ranks, dense parameters over all, experts FSDP-sharded over the rest); EP = world
with activation checkpointing of decoder and vision blocks.
"""

from __future__ import annotations

import pytest
from dist_checks import STEPS, check_training_equals_one_process, layout_recipe

from dist_testkit import named_check, run_checks
from qwen35_trainer import train

LAYOUTS = {
    "fsdp": (),
    "ep2": ("parallel.ep=2",),
    "ep_all_ac": ("parallel.ep={world}", "train.activation_checkpointing=true"),
}


@pytest.fixture(scope="module")
def reference():
    result = train(layout_recipe(1))
    state = {k: v.detach().clone() for k, v in result.objective.model.state_dict().items()}
    assert len(result.logs) == STEPS and result.logs[-1].loss < result.logs[0].loss
    return result.logs, state


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def launch(request, reference):
    world = request.param
    checks = {
        name: named_check(
            f"{name}@{world}",
            check_training_equals_one_process,
            tuple(o.format(world=world) for o in overrides),
            *reference,
        )
        for name, overrides in LAYOUTS.items()
    }
    return checks, run_checks(list(checks.values()), world, timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_equals_one_process(launch, layout):
    checks, report = launch
    report.assert_passed(checks[layout])
