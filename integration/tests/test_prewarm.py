"""``train.prewarm``: cuBLAS, communicator and fla prewarms before the first step, reported."""

from __future__ import annotations

import logging

from helpers import tiny

from qwen35_trainer import train


def test_prewarm_runs_before_the_first_step_and_reports(caplog):
    with caplog.at_level(logging.INFO, logger="qwen35_trainer"):
        result = train(tiny("train.steps=1", "train.prewarm=true"))
    assert len(result.logs) == 1
    report = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("prewarm:"))
    assert "cublas" in report and "comm_groups" in report
