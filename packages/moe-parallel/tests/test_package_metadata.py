"""The installed distribution and the import agree on the version (one place to bump)."""

from importlib.metadata import version

import moe_parallel


def test_version_matches_distribution():
    assert moe_parallel.__version__ == version("moe-parallel")
