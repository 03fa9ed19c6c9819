"""Compile settings shared by the compiled tests."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def no_graph_cache():
    """Compile for real (the recorded passes must run) but keep the on-disk kernel cache, and
    compile in-process (a worker pool costs more than it saves on a 2-core machine)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with (
        inductor_config.patch(fx_graph_cache=False, compile_threads=1),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        yield
