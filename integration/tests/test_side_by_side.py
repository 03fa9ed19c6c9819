"""``tools/side_by_side.py`` (the noxfile's ``tests`` session): the streams run at once, each
stream's suites in order, a suite stops at its first failing command and the others go on, and
each suite's output is printed whole under its heading."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "tools" / "side_by_side.py"


def _module():
    spec = importlib.util.spec_from_file_location("side_by_side", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["side_by_side"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_streams_run_at_once_suites_in_order_and_a_failure_ends_only_its_suite(tmp_path):
    tool = _module()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    env = tool.environment({"SIDE_BY_SIDE": "set", "PYTHONWARNINGS": None})
    assert env["SIDE_BY_SIDE"] == "set" and "PYTHONWARNINGS" not in env
    # "reader" blocks until "writer", in the other stream, opens the pipe, and the writer until
    # the reader does: one stream after the other, both die of their 60 s alarm
    wait = "import signal; signal.alarm(60); "
    reader = tool.Suite(
        "reader", tmp_path, [_py(f"{wait}print('read', open({str(fifo)!r}).read())")], env
    )
    after = tool.Suite(
        "after", tmp_path, [_py("import os; print('after', os.environ['SIDE_BY_SIDE'])")], env
    )
    writer = tool.Suite(
        "writer", tmp_path, [_py(f"{wait}open({str(fifo)!r}, 'w').write('x')")], env
    )
    failing = tool.Suite(
        "failing",
        tmp_path,
        [_py("print('first')"), _py("raise SystemExit(3)"), _py("print('never')")],
        env,
    )
    said: list[str] = []
    ended = tool.run_streams([[reader, after], [failing, writer]], tmp_path / "logs", said.append)
    assert {name: e.code for name, e in ended.items()} == {
        "reader": 0,
        "after": 0,
        "failing": 3,
        "writer": 0,
    }
    headings = [line for line in said if line.startswith("=====")]
    order = [h.split()[1].rstrip(":") for h in headings]
    assert order.index("reader") < order.index("after")  # a stream's suites in order
    assert order.index("failing") < order.index("writer")
    assert headings[order.index("failing")].startswith("===== failing: FAILED (exit code 3) in ")
    assert headings[order.index("writer")].startswith("===== writer: passed in ")
    # each suite's whole log right after its heading: its commands and their output
    logs = dict(zip(order, said[1::2], strict=True))
    assert "first\n" in logs["failing"] and "never" not in logs["failing"]
    assert logs["failing"].count("$ ") == 2  # the third command never ran
    assert "read x\n" in logs["reader"] and "after set\n" in logs["after"]
