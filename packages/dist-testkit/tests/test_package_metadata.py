"""The installed distribution and the import agree on the version (one place to bump)."""

from importlib.metadata import version

import dist_testkit


def test_version_matches_distribution():
    assert dist_testkit.__version__ == version("dist-testkit")
