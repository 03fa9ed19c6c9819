"""The README's examples run (``dist_testkit.readme``), and the runner finds, launches and fails
examples as it says."""

from __future__ import annotations

import pytest

from dist_testkit.readme import Example, readme_examples, readme_test, run_example

test_readme = readme_test(__file__)

TEXT = """# pkg

```python
print("one")
```

```py
not run
```

```python
# torchrun --nproc-per-node 2 example.py
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} done", flush=True)  # one write: ranks share the pipe
dist.barrier()
dist.destroy_process_group()
```
"""


def test_examples_are_the_python_blocks_with_their_lines(tmp_path):
    (tmp_path / "README.md").write_text(TEXT)
    first, second = readme_examples(tmp_path / "README.md")
    assert (first.line, first.code, first.nproc) == (4, 'print("one")\n', None)
    assert second.line == 12 and second.nproc == 2
    output = run_example(second, timeout=120)
    assert "rank 1 done" in output and "rank 0 done" in output, output


def test_a_failing_example_names_its_line_and_shows_its_output(tmp_path):
    bad = Example(tmp_path / "README.md", 7, "print('before')\nraise SystemExit(3)\n")
    with pytest.raises(AssertionError, match=r"README\.md:7: exit code 3\nbefore"):
        run_example(bad)
    slow = Example(tmp_path / "README.md", 9, "import time\ntime.sleep(60)\n")
    with pytest.raises(AssertionError, match="still running after 2 s"):
        run_example(slow, timeout=2)


def test_an_unclosed_block_is_an_error(tmp_path):
    (tmp_path / "README.md").write_text("```python\nprint(1)\n")
    with pytest.raises(ValueError, match=r"README\.md:1: code block never closed"):
        readme_examples(tmp_path / "README.md")


def _torchrun_example(tmp_path, body: str) -> Example:
    return Example(tmp_path / "README.md", 3, "# torchrun --nproc-per-node 1 x.py\n" + body)


def test_only_the_gloo_teardown_abort_is_run_again(tmp_path):
    marker = tmp_path / "ran_once"
    flaky = _torchrun_example(tmp_path, (
        "import pathlib, sys\n"
        f"marker = pathlib.Path({str(marker)!r})\n"
        "if not marker.exists():\n"
        "    marker.touch()\n"
        "    print('terminate called without an active exception', flush=True)\n"
        "    sys.exit(1)\n"
        "print('second attempt ok', flush=True)\n"
    ))  # fmt: skip
    assert "second attempt ok" in run_example(flaky, timeout=120)
    other = _torchrun_example(tmp_path, f"open({str(tmp_path / 'n')!r}, 'a').write('x')\n"
                                        "raise SystemExit(3)\n")  # fmt: skip
    with pytest.raises(AssertionError, match="exit code 1") as failed:
        run_example(other, timeout=120)
    assert "next attempt" not in str(failed.value)
    assert (tmp_path / "n").read_text() == "x"  # ran once
