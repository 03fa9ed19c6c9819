"""The installed distribution and the import agree on the version (one place to bump)."""

from importlib.metadata import version

import fsdp_compat


def test_version_matches_distribution():
    assert fsdp_compat.__version__ == version("fsdp-compat")
