"""Many checks per launch: a gloo launch costs seconds, a check usually milliseconds.

``run_checks`` runs a list of check functions, in order, on every rank of ONE launch and returns
a per-check report. A check passes when it returns on every rank. When a check raises on some
rank, that rank records the traceback and stops (the collectives of the remaining checks could
be mis-paired with a peer that is still inside the failing one); its peers either fail the same
check (well-behaved code agrees before raising) or are killed after a grace period. Checks that
did not get to run are reported as not run, with the reason.

Typical use in a test module::

    CHECKS = [check_forward, check_backward, check_uneven]

    @pytest.fixture(scope="module")
    def report():
        return run_checks(CHECKS, world_size=2)

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_rank_check(report, check):
        report.assert_passed(check)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from dist_testkit.launch import DEFAULT_TIMEOUT_S, Outcome, launch, report_progress

__all__ = ["CheckReport", "named_check", "run_checks"]

Check = Callable[[], Any]


@dataclasses.dataclass
class CheckReport:
    """Per check name: ``None`` when it passed on every rank, else the failure text; and, for
    each check that passed, its ``seconds`` (the slowest rank's, from the end of the check before
    it on that rank)."""

    world_size: int
    failures: dict[str, str | None]
    results: dict[str, list[Any]]
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def assert_passed(self, check: Check | str) -> list[Any]:
        """Raise ``AssertionError`` with the failing ranks' tracebacks; return per-rank results."""
        name = check if isinstance(check, str) else check.__name__
        if name not in self.failures:
            raise KeyError(f"no check named {name!r}; have {sorted(self.failures)}")
        error = self.failures[name]
        if error is not None:
            raise AssertionError(f"check {name} failed at world {self.world_size}:\n{error}")
        return self.results[name]

    def assert_all_passed(self) -> None:
        failed = {k: v for k, v in self.failures.items() if v is not None}
        if failed:
            body = "\n\n".join(f"== {k} ==\n{v}" for k, v in failed.items())
            raise AssertionError(f"{len(failed)} of {len(self.failures)} checks failed:\n{body}")


def named_check(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Check:
    """A parametrized check: ``fn(*args, **kwargs)`` under ``name`` (picklable, unlike a closure)."""
    check = functools.partial(fn, *args, **kwargs)
    check.__name__ = name  # type: ignore[attr-defined]  # partial keeps its __dict__ when pickled
    return check


def _run_all(checks: Sequence[Check]) -> None:
    """One rank: run the checks in order, reporting each result as soon as it passes, so that
    a later hang or crash cannot erase what already passed. The first failure ends the rank."""
    for check in checks:
        report_progress(check())


def run_checks(
    checks: Sequence[Check],
    world_size: int,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> CheckReport:
    """Run every check (a picklable zero-argument function) on ``world_size`` ranks in one launch.

    Per rank, a check passed when the rank reported its result; the first check a rank did not
    get past carries that rank's error (traceback, exit code or "hung"); later ones are not run.
    With ``DIST_TESTKIT_TIMINGS`` set to a file, one JSON line per passed check is appended to it
    (world size, name, seconds): what each check of a long launch costs.
    """
    names = [c.__name__ for c in checks]
    if len(set(names)) != len(names):
        raise ValueError(f"check names must be unique, got {names}")
    outcomes = launch(_run_all, world_size, list(checks), timeout=timeout, env=env)
    failures: dict[str, str | None] = {}
    results: dict[str, list[Any]] = {}
    seconds = _seconds(names, outcomes)
    for i, name in enumerate(names):
        errors, values = [], []
        for rank, outcome in enumerate(outcomes):
            passed = outcome.progress
            if i < len(passed):
                values.append(passed[i])
            elif i == len(passed):
                errors.append(f"----- rank {rank} -----\n{outcome.error.rstrip()}")
            else:
                errors.append(
                    f"----- rank {rank}: not run (check {names[len(passed)]} failed first)"
                )
        failures[name] = "\n".join(errors) if errors else None
        if not errors:
            results[name] = values
    report = CheckReport(world_size, failures, results, seconds)
    if os.environ.get("DIST_TESTKIT_TIMINGS"):
        with open(os.environ["DIST_TESTKIT_TIMINGS"], "a") as out:
            for name, took in seconds.items():
                out.write(json.dumps({"world": world_size, "check": name, "seconds": took}) + "\n")
    return report


def _seconds(names: Sequence[str], outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Per check every rank passed: the slowest rank's time from its previous report."""
    out = {}
    for i, name in enumerate(names):
        spans = [
            o.progress_seconds[i] - (o.progress_seconds[i - 1] if i else 0.0)
            for o in outcomes
            if i < len(o.progress_seconds)
        ]
        if len(spans) == len(outcomes):
            out[name] = round(max(spans), 3)
    return out
