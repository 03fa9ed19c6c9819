"""The installed distribution and the import agree on the version (one place to bump)."""

from importlib.metadata import version

import chunked_loss


def test_version_matches_distribution():
    assert chunked_loss.__version__ == version("chunked-loss")
