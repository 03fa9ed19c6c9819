"""Run a README's Python examples as tests, so a stale example fails CI.

Every fenced block whose info string is exactly ``python`` is an example and must run as it
stands, in a fresh interpreter (fragments that are not meant to run are fenced as ``py``). A
block whose first line is ``# torchrun --nproc-per-node N ...`` runs under torchrun with ``N``
local ranks (``--standalone``: a free port on this machine), as a user would run it. Each
example runs in a temporary directory with a timeout; a failure names the README line where the
block starts and shows the output.

In a package's test suite::

    from dist_testkit.readme import readme_test

    test_readme = readme_test(__file__)  # every example of ../README.md, one test each
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["Example", "readme_examples", "readme_test", "run_example"]

_FENCE = re.compile(r"^```(\S*)\s*$")
_TORCHRUN = re.compile(r"^#\s*torchrun\b.*--nproc[-_]per[-_]node[= ](\d+)")


@dataclasses.dataclass(frozen=True)
class Example:
    """One ``python`` block: where it starts (1-based line of its first code line) and its code."""

    readme: Path
    line: int
    code: str

    @property
    def nproc(self) -> int | None:
        """Ranks to launch under torchrun, or ``None`` for a plain interpreter."""
        first = self.code.splitlines()[0] if self.code else ""
        match = _TORCHRUN.match(first)
        return int(match.group(1)) if match else None

    def __str__(self) -> str:
        return f"{self.readme.parent.name}/README.md:{self.line}"


def readme_examples(readme: str | Path) -> list[Example]:
    """The ``python`` blocks of ``readme`` in order; an unterminated block is an error."""
    path = Path(readme)
    out: list[Example] = []
    lang, start, lines = None, 0, []
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        fence = _FENCE.match(text)
        if lang is None and fence:
            lang, start, lines = fence.group(1), number + 1, []
        elif lang is not None and text.rstrip() == "```":
            if lang == "python":
                out.append(Example(path, start, "\n".join(lines) + "\n"))
            lang = None
        elif lang is not None:
            lines.append(text)
    if lang is not None:
        raise ValueError(f"{path}:{start - 1}: code block never closed")
    return out


# What a gloo rank prints when it aborts while the interpreter exits (std::terminate on a worker
# thread that is still joinable); it happens now and then even after destroy_process_group.
TEARDOWN_ABORT = "terminate called without an active exception"
TEARDOWN_RETRIES = 2


def _run_once(example: Example, timeout: float) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory() as work:
        script = Path(work) / "example.py"
        script.write_text(example.code)
        command = [sys.executable, str(script)]
        if example.nproc is not None:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={example.nproc}", str(script)]  # fmt: skip
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise AssertionError(
                f"{example}: still running after {timeout:.0f} s\n{output}"
            ) from None
    return proc.returncode, output


def run_example(example: Example, *, timeout: float = 300.0) -> str:
    """Run ``example``; return its output, or raise ``AssertionError`` with it on failure/timeout.

    A torchrun example whose only fault is gloo's teardown abort (:data:`TEARDOWN_ABORT` in the
    output of a failed run) is run again, at most :data:`TEARDOWN_RETRIES` times; any other
    failure, or the abort every time, fails with every attempt's output."""
    failures = []
    for _ in range(1 + (TEARDOWN_RETRIES if example.nproc is not None else 0)):
        code, output = _run_once(example, timeout)
        if code == 0:
            return output
        failures.append(f"exit code {code}\n{output}")
        if TEARDOWN_ABORT not in output:
            break
    raise AssertionError(f"{example}: " + "\n--- next attempt ---\n".join(failures))


def readme_test(test_file: str | Path, *, timeout: float = 300.0):
    """A pytest test running every example of the README next to ``test_file``'s folder
    (``tests/../README.md``), one parametrized case each; the README must have one."""
    import pytest

    readme = Path(test_file).resolve().parents[1] / "README.md"
    examples = readme_examples(readme)
    if not examples:
        raise ValueError(f"{readme} has no python example")

    @pytest.mark.parametrize("example", examples, ids=str)
    def test_readme_example(example: Example) -> None:
        run_example(example, timeout=timeout)

    return test_readme_example
