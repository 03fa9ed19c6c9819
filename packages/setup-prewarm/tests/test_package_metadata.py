"""The installed distribution and the import agree on the version (one place to bump)."""

from importlib.metadata import version

import setup_prewarm


def test_version_matches_distribution():
    assert setup_prewarm.__version__ == version("setup-prewarm")
