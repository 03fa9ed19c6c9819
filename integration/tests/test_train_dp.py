"""Data parallelism with FSDP2 takes the same steps as one process (gloo, world 2 and 4).

The reference runs here, in one process, on the global batch (``dp=1`` with all the rows);
each rank of the launch trains its share and compares with it. At world 4 each rank holds one
row and the smallest parameters leave some ranks with empty local shards.
"""

from __future__ import annotations

import pytest
from dist_checks import GLOBAL_SAMPLES, STEPS, check_dp_training_equals_one_process, dp_recipe

from dist_testkit import named_check, run_checks
from qwen35_trainer import train


@pytest.fixture(scope="module")
def reference():
    result = train(dp_recipe(1))
    return result.logs, {
        k: v.detach().clone() for k, v in result.objective.model.state_dict().items()
    }


@pytest.mark.parametrize("world", [2, 4])
def test_dp_fsdp2_training_equals_one_process(reference, world):
    logs, state = reference
    assert len(logs) == STEPS and logs[-1].loss < logs[0].loss
    check = named_check(f"dp{world}", check_dp_training_equals_one_process, logs, state)
    report = run_checks([check], world, timeout=240)
    report.assert_passed(check)
    assert GLOBAL_SAMPLES % world == 0
