"""The installed distribution and the import agree on the version (one place to bump)."""

from importlib.metadata import version

import async_tp_linear


def test_version_matches_distribution():
    assert async_tp_linear.__version__ == version("async-tp-linear")
