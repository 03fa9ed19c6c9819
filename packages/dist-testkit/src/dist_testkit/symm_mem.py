"""Let Inductor's micro-pipeline TP pass (async TP) rewrite graphs on CPU gloo ranks:
:func:`cpu_micro_pipeline_tp`.

The pass (``torch._inductor.fx_passes.micro_pipeline_tp``, on when
``torch._inductor.config._micro_pipeline_tp`` is set) replaces an all-gather feeding matmuls by
``symm_mem.fused_all_gather_matmul`` and a matmul feeding a reduce-scatter by
``symm_mem.fused_matmul_reduce_scatter``. It rewrites a site only if ``torch.distributed`` has
NCCL and the group has symmetric memory, and the fused ops have CUDA kernels only; on a CPU it
leaves every site alone, silently. So whether a model's compiled graphs have the shape the pass
fuses, and whether the fused graph computes what the unfused one does, cannot be seen on a CPU.

Inside :func:`cpu_micro_pipeline_tp` the pass's two checks pass, and the fused ops get CPU
kernels: torch's own reference implementations of them (``_fused_all_gather_matmul_fallback``,
``_fused_matmul_reduce_scatter_fallback``: the all-gather / reduce-scatter as functional
collectives around plain matmuls, what torch registers for tracing), which gloo runs. Every call
of a fused kernel is counted, so a test sees that the rewritten graphs ran. Inductor's on-disk
caches (FX graphs, AOT autograd) are off inside: their key does not include these checks, so a
graph compiled earlier without them would come back unfused, and the pass would not see it.

Why it is exact: the fallbacks compute the unfused math, the collective and the matmuls, on the
same inputs; only the overlap of the two, which a CPU does not have, is missing. What it does NOT
test is the CUDA kernels' pipelining through symmetric memory, nor that the group has symmetric
memory: that stays with the GPU tests (async-tp-linear's ``enable_async_tp`` checks it up front).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist

__all__ = ["cpu_micro_pipeline_tp"]

FUSED_OPS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")
_CALLS: Counter[str] = Counter()  # per process: the kernels stay registered once registered
_LIBRARIES: list[torch.library.Library] = []


def _register_cpu_kernels() -> None:
    """CPU kernels for the fused ops (once per process), counting their calls."""
    if _LIBRARIES:
        return
    from torch.distributed import _symmetric_memory as symm_mem

    def all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A=True):
        _CALLS["fused_all_gather_matmul"] += 1
        return symm_mem._fused_all_gather_matmul_fallback(
            A_shard, Bs, gather_dim, group_name, return_A=return_A
        )

    def matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
        _CALLS["fused_matmul_reduce_scatter"] += 1
        return symm_mem._fused_matmul_reduce_scatter_fallback(
            A, B, reduce_op, scatter_dim, group_name
        )

    library = torch.library.Library("symm_mem", "IMPL")
    library.impl("fused_all_gather_matmul", all_gather_matmul, "CPU")
    library.impl("fused_matmul_reduce_scatter", matmul_reduce_scatter, "CPU")
    _LIBRARIES.append(library)


@contextlib.contextmanager
def cpu_micro_pipeline_tp() -> Iterator[Counter[str]]:
    """Inside: the micro-pipeline TP pass rewrites on CPU ranks and the fused ops run (module
    docstring); yields a counter of the fused kernels' calls made inside, by op name (filled in on exit). The pass's
    checks are restored on exit; turning the pass on (the Inductor flag) is the caller's, as on a
    GPU. Refuses on a machine with a GPU, where the real kernels must run."""
    if torch.cuda.is_available():
        raise RuntimeError(
            "cpu_micro_pipeline_tp() stands in for async TP's CUDA kernels on a CPU-only "
            "machine; this one has a GPU: run the code on it"
        )
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symm_mem

    _register_cpu_kernels()
    before = Counter(_CALLS)
    calls: Counter[str] = Counter()
    with (
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
        mock.patch.object(dist, "is_nccl_available", lambda: True),
        mock.patch.object(symm_mem, "is_symm_mem_enabled_for_group", lambda group_name: True),
    ):
        try:
            yield calls
        finally:
            calls.update({op: _CALLS[op] - before[op] for op in FUSED_OPS})
