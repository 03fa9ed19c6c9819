"""The learning-rate schedule at chosen steps, and that the loop applies it every step."""

from __future__ import annotations

import math

import pytest
from helpers import tiny

from qwen35_trainer import train
from qwen35_trainer.train.schedule import lr_at


def _spec(**values):
    return tiny(*(f"train.{k}={v}" for k, v in values.items())).train


@pytest.mark.parametrize(
    ("schedule", "warmup", "expected"),
    [
        ("constant", 4, {0: 0.25, 1: 0.5, 3: 1.0, 9: 1.0}),
        ("linear", 3, {0: 1 / 3, 2: 1.0, 3: 1.0, 6: 1 - 0.9 * 3 / 7, 9: 1 - 0.9 * 6 / 7}),
        (
            "cosine",
            0,
            {
                0: 1.0,
                5: 0.1 + 0.9 * (1 + math.cos(math.pi / 2)) / 2,
                9: 0.1 + 0.9 * (1 + math.cos(math.pi * 9 / 10)) / 2,
            },
        ),
    ],
)
def test_values_at_chosen_steps(schedule, warmup, expected):
    spec = _spec(lr=1.0, steps=10, warmup_steps=warmup, schedule=schedule, lr_floor=0.1)
    for step, value in expected.items():
        assert lr_at(step, spec) == pytest.approx(value), (schedule, step)


def test_the_loop_applies_it_and_logs_it():
    logs = train(
        tiny("train.steps=4", "train.warmup_steps=2", "train.lr=0.01", "train.schedule=linear")
    ).logs
    assert [log.lr for log in logs] == pytest.approx([0.005, 0.01, 0.01, 0.005])


def test_scientific_notation_is_a_number():
    assert tiny("train.lr=3e-4").train.lr == 3e-4  # YAML 1.1 reads it as the string "3e-4"
