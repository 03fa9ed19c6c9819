"""The order in which pytest-xdist hands this suite's files to its two workers (the noxfile runs
it with ``-n 2 --dist loadfile --no-loadscope-reorder``): the longest files first, then the
rest in collection order.

A worker runs a whole file (its module-scoped gloo launches stay in one process) and takes the
next file in line once it has at most two tests left. xdist's default line is by number of
tests, most first, which put the two-test torchrun fault file (about 3 min) and the other few-
test, long files last: at the end one worker ran them while the other idled (the trainer suite
took 1378 s on two workers for about 2200 s of tests). Longest first, the files left for the
end are the short ones (1026 s in CI on 2026-12-03, with bytecode written; 1316 to 1378 s in
xdist's order without).
"""

from __future__ import annotations

# summed test time per file on two workers, longest first (CI of 2026-12-03, test_plan.py's
# after its world-4 launches became one)
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
