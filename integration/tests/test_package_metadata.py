"""The installed distribution and the import agree on the version (one place to bump)."""

from importlib.metadata import version

import qwen35_trainer


def test_version_matches_distribution():
    assert qwen35_trainer.__version__ == version("qwen35-trainer")
