"""The order in which pytest-xdist hands this suite's files to its two workers (the noxfile runs
it with ``-n 2 --dist loadfile --no-loadscope-reorder``): the longest files first, then the
rest in collection order.

A worker runs a whole file (its module-scoped gloo launches stay in one process) and takes the
next file in line once it has at most two tests left. xdist's default line is by number of
tests, most first, which put the two-test torchrun fault file and the other few-test, long files
last: at the end one worker ran them while the other idled. Longest first, the files left for
the end are the short ones.
"""

from __future__ import annotations

# longest first, by each file's summed test time in the CI durations of 2026-12-03
LONGEST_FIRST = (
    "test_train_dp.py",
    "test_assembly.py",
    "test_plan.py",
    "test_faults.py",
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
