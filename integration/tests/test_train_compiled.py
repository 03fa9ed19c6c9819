"""The compiled layouts take the same steps as one eager process (gloo, world 2):
CP 2 x EP 2 and TP 2 + SP with every block compiled (``train.compile``, with
checkpointing and the MTP head); TP 2 also with async TP (``parallel.async_tp``: Inductor's
micro-pipeline TP pass fusing the blocks' collectives into their matmuls on these CPU ranks,
``dist_testkit.cpu_micro_pipeline_tp``); megatron-fsdp CP 2 with compiled blocks. They are a file
of their own: Inductor's CPU code generation takes minutes on a cold cache, and the suite's
other worker runs other files meanwhile."""

from __future__ import annotations

import pytest
from layout_launch import LAYOUTS, layout_checks, one_process_references
from train_layouts import COMPILED

from dist_testkit import run_checks


@pytest.fixture(scope="module")
def references():
    return one_process_references([LAYOUTS[name][1] for name in COMPILED], fp8_base=None)


@pytest.fixture(scope="module")
def launch(references):
    checks = layout_checks(COMPILED, 2, {"world": 2, "half": 1, "rows": 4}, references, {})
    return checks, run_checks(list(checks.values()), 2, timeout=900)


@pytest.mark.parametrize("layout", COMPILED)
def test_compiled_layout_equals_one_eager_process(launch, layout):
    checks, report = launch
    report.assert_passed(checks[layout])
