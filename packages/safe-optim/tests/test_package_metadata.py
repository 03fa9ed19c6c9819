"""The installed distribution and the import agree on the version (one place to bump)."""

from importlib.metadata import version

import safe_optim


def test_version_matches_distribution():
    assert safe_optim.__version__ == version("safe-optim")
