"""host_memory: the peak and held RSS growth of a block, against a buffer of known size written
inside it (a fresh interpreter, so nothing else allocates meanwhile)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

MB = 1 << 20


def test_peak_and_held_against_a_known_buffer():
    code = textwrap.dedent(
        """
        import torch
        from dist_testkit import host_memory
        with host_memory() as freed:
            scratch = torch.ones(64 << 18)  # 64 MiB of fp32, written
            del scratch
        with host_memory() as kept:
            buffer = torch.ones(32 << 18)  # 32 MiB, still alive at the end
        print(freed.peak, freed.held, kept.peak, kept.held)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    freed_peak, freed_held, kept_peak, kept_held = map(int, out.stdout.split())
    assert 64 * MB <= freed_peak < 72 * MB, out.stdout
    assert freed_held < 8 * MB, out.stdout  # given back
    assert 32 * MB <= kept_held <= kept_peak < 40 * MB, out.stdout
