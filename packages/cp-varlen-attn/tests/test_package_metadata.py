"""The installed distribution and the import agree on the version (one place to bump)."""

from importlib.metadata import version

import cp_varlen_attn


def test_version_matches_distribution():
    assert cp_varlen_attn.__version__ == version("cp-varlen-attn")
