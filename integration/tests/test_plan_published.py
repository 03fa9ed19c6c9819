"""The step-time model against the published Qwen3.6-35B-A3B runs: the table of
``docs/scaling.md`` is what ``qwen35-train plan --published`` prints (so the model cannot drift
without the docs saying so), nothing in it is fitted to a run, and every prediction is the
bound the docs call it: faster than the published step, whose stack pays what the prediction
leaves out (launch gaps, elementwise work)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from qwen35_trainer.plan import published
from qwen35_trainer.plan.hardware import hardware
from qwen35_trainer.plan.planner import plan
from qwen35_trainer.plan.timing import Efficiency

SCALING = Path(__file__).parents[1] / "docs" / "scaling.md"


@pytest.fixture(scope="module")
def planner():
    """:func:`plan`, each run planned once for the module."""
    planned = {}

    def once(recipe, *, name):
        if name not in planned:
            planned[name] = plan(recipe, name=name)
        return planned[name]

    return once


@pytest.fixture(scope="module")
def table(planner) -> str:
    return published.published_table(planner)


def test_the_docs_table_is_the_printed_one(table):
    assert table in SCALING.read_text(), "run `qwen35-train plan --published` and update the docs"
    assert "Efficiencies: each GPU's published kernel measurements" in table
    assert "calibrat" not in table.lower()


@pytest.mark.parametrize("run", published.RUNS, ids=lambda r: r.name)
def test_every_prediction_is_the_kernels_bound_of_its_run(run, planner):
    """Faster than the published step: the prediction counts the kernels only, at their
    published rates, and the published stack pays what lies between them too."""
    t = published.predict(run, planner)
    assert published.step_at_published_tokens(run, t) < run.seconds
    # the efficiencies are what the prediction hangs on: faster kernels, a shorter step
    gpu = hardware(run.gpu)
    faster = dataclasses.replace(Efficiency.of(gpu), matmul=1.0, grouped=1.0)
    assert published.predict(run, planner, faster).seconds < t.seconds
