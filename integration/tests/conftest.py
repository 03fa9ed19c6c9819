"""The suite's shared fixtures (the demo dataset and its encoder), and the order in which
pytest-xdist hands this suite's files to its two workers (the noxfile runs
it with ``-n 2 --dist loadfile --no-loadscope-reorder``): the longest files first, then the
rest in collection order.

A worker runs a whole file (its module-scoped gloo launches stay in one process) and takes the
next file in line once it has at most two tests left. xdist's default line is by number of
tests, most first, which put the two-test torchrun fault file and the other few-test, long files
last: at the end one worker ran them while the other idled. Longest first, the files left for
the end are the short ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# longest first, by each file's summed test time in the CI durations of 2026-12-03 (the layout
# launches split over three files on 2026-12-06)
LONGEST_FIRST = (
    "test_train_dp.py",
    "test_train_matrix.py",
    "test_faults.py",
    "test_train_compiled.py",
    "test_assembly.py",
    "test_plan.py",
    "test_meta_build.py",
    "test_cli.py",
    "test_data_layouts.py",
    "test_pip_install.py",
    "test_demo.py",
)


def pytest_collection_modifyitems(items):
    """The files of :data:`LONGEST_FIRST` first, in its order; a stable sort keeps every
    file's own test order and the other files' collection order."""
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """The demo dataset (4 training rows) with a 4-frame mp4 beside it (``four.mp4``)."""
    import random

    from qwen35_trainer.demo.dataset import _motion_frames, _write_mp4, make_demo

    root = make_demo(tmp_path_factory.mktemp("demo"), train_rows=4, heldout_rows=1)
    assert _write_mp4(_motion_frames("left", (230, 40, 40), random.Random(0)), root / "four.mp4")
    return root


@pytest.fixture(scope="module")
def encoder(demo):
    """The demo processor's encoder for the tiny recipe's model."""
    from helpers import tiny

    from qwen35_trainer import build_config
    from qwen35_trainer.data.conversation import ConversationEncoder, TokenIds

    return ConversationEncoder(
        str(demo / "processor"), TokenIds(120, 121, 122, 123), build_config(tiny().model)
    )
