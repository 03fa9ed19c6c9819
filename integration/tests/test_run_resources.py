"""Runs release what they create (:mod:`qwen35_trainer.parallel.resources`), in one process
here; on 2 gloo ranks in ``test_train_dp.py``'s launch (``runs_release``)."""

from __future__ import annotations

import pytest
from resource_checks import check_runs_release_what_they_create

from qwen35_trainer import train
from qwen35_trainer.parallel.resources import live_groups


def test_one_process_runs_release_their_groups_and_threads(tmp_path):
    before = len(live_groups())  # 0 unless an earlier test of this process holds a run
    counts = check_runs_release_what_they_create(str(tmp_path))
    assert counts[0][1] == len(live_groups()) == before  # the one-rank group went with its run


def test_a_closed_result_says_so(tmp_path):
    from dist_checks import layout_recipe

    with train(layout_recipe(1)) as result:
        assert set(result.state_dict())
    with pytest.raises(RuntimeError, match="this TrainResult was closed"):
        result.state_dict()
