"""``train.deterministic``: the same recipe, launch and machine repeat bit for bit — one process
on 2 threads here (synthetic data with activation checkpointing; the demo dataset read by 2
loader workers), the tiny recipe's own 4 ranks on its demo data in test_train_dp.py
(``repeat_*``: as it is, and with activation checkpointing and accumulation; every number of
metrics.jsonl and the final checkpoint's shard files byte for byte).

The drift these runs had came from gathers whose backward added gradient rows with atomics in
thread-timing order (cp-varlen-attn's conv and chunked rule, moe-parallel's token copies);
their own tests repeat that backward 100-300 times on 2 threads and fail when the gather is put
back (a race is too rare to catch reliably in a handful of training runs)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import ONE_PROCESS, TINY, tiny
from torch._prims_common import alert_not_deterministic

from qwen35_trainer import load_recipe, train
from qwen35_trainer.train.determinism import deterministic_mode


@pytest.mark.parametrize(
    "recipe",
    [
        lambda: tiny("train.steps=3", "train.activation_checkpointing=true"),
        lambda: load_recipe(
            TINY, [*ONE_PROCESS, "train.steps=3", "train.eval_every=0", "data.workers=2"]
        ),
    ],
    ids=["synthetic_ac", "demo_workers2"],
)
def test_one_process_on_two_threads_repeats_bit_for_bit(recipe):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = [train(recipe()) for _ in "ab"]
    finally:
        torch.set_num_threads(threads)
    (a, b) = runs
    assert [(x.loss, x.grad_norm, x.aux) for x in a.logs] == [
        (y.loss, y.grad_norm, y.aux) for y in b.logs
    ]
    state = b.state_dict()
    assert all(torch.equal(value, state[name]) for name, value in a.state_dict().items())


def test_the_mode_is_on_for_the_run_and_names_what_has_none(caplog):
    seen = []
    train(
        tiny("train.steps=1"),
        on_step=lambda log: seen.append(torch.are_deterministic_algorithms_enabled()),
    )
    assert seen == [True] and not torch.are_deterministic_algorithms_enabled()  # restored
    train(
        tiny("train.steps=1", "train.deterministic=false"),
        on_step=lambda log: seen.append(torch.are_deterministic_algorithms_enabled()),
    )
    assert seen == [True, False]
    with caplog.at_level(logging.WARNING, logger="qwen35_trainer"), deterministic_mode(True):
        for _ in range(3):
            alert_not_deterministic("some_scatter_kernel")  # PyTorch's own alert
    named = [r.getMessage() for r in caplog.records if "some_scatter_kernel" in r.getMessage()]
    assert len(named) == 1 and "has no deterministic implementation" in named[0]
