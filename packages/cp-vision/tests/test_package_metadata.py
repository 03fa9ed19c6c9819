"""The installed distribution and the import agree on the version (one place to bump)."""

from importlib.metadata import version

import cp_vision


def test_version_matches_distribution():
    assert cp_vision.__version__ == version("cp-vision")
