"""Test-only helpers: run functions on N ranks of a real gloo process group, build CPU device
meshes, and compare sharded results with single-process references.

The public entry points:

- :func:`run_ranks` — call a function on N spawned gloo ranks, get each rank's result; a rank's
  exception, crash or hang becomes a :class:`RankError` with its traceback / exit code / name.
- :func:`run_checks` — many checks in one launch, reported per check (:class:`CheckReport`).
- :func:`make_mesh` — a named CPU ``DeviceMesh`` inside a launched rank.
- :func:`assert_close` / :func:`assert_grads_close` — parity with the worst element printed.
- :func:`host_memory` — the peak and held host RSS growth of a block of code (bytes).
- :func:`cpu_cuda_streams` — CPU stand-ins for ``torch.cuda`` streams and events, so a library
  written against CUDA streams (megatron-fsdp) runs on gloo ranks.
- :func:`cpu_micro_pipeline_tp` — Inductor's async-TP pass rewrites compiled graphs on CPU ranks,
  the fused collective-matmul ops running torch's reference kernels (calls counted).
"""

from dist_testkit.checks import CheckReport, named_check, run_checks
from dist_testkit.compare import assert_close, assert_grads_close, full
from dist_testkit.cuda_streams import cpu_cuda_streams
from dist_testkit.launch import Outcome, RankError, launch, report_progress, run_ranks
from dist_testkit.memory import HostMemory, host_memory
from dist_testkit.mesh import make_mesh
from dist_testkit.symm_mem import cpu_micro_pipeline_tp

__version__ = "0.3.0"

__all__ = [
    "CheckReport",
    "HostMemory",
    "Outcome",
    "RankError",
    "__version__",
    "assert_close",
    "assert_grads_close",
    "cpu_cuda_streams",
    "cpu_micro_pipeline_tp",
    "full",
    "host_memory",
    "launch",
    "make_mesh",
    "named_check",
    "report_progress",
    "run_checks",
    "run_ranks",
]
