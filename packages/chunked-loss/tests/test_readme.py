"""The README's examples run as they stand (``dist_testkit.readme``)."""

from dist_testkit.readme import readme_test

test_readme = readme_test(__file__)
