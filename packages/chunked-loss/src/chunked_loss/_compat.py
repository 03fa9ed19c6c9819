"""The private torch internals this package relies on, reached in one place.

The compiled per-chunk kernels (``_kernels``) use: the exception class that ``torch.compile``
raises when it cannot trace or build a kernel, whether Inductor supports this Python/platform at
all, the process-wide "compile disabled" switch, and whether a ``TorchDispatchMode`` is active
(Dynamo does not compile under one). Each is looked up on first use with a message naming what
is missing, so a torch that moved them fails loudly. The CPU matmuls (``_matmul``) use oneDNN's
linear op, which a torch build may lack: its absence is an answer (None), not an error.
"""

from __future__ import annotations

import importlib

import torch

__all__ = [
    "compile_disabled",
    "compile_errors",
    "dispatch_mode_active",
    "inductor_supported",
    "onednn_linear",
]


def _attr(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            f"chunked_loss needs {module}.{name}, which this torch does not provide: {err}"
        ) from err


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compilation raises: every Dynamo/Inductor error derives from this class."""
    return (_attr("torch._dynamo.exc", "TorchDynamoException"),)


def inductor_supported() -> bool:
    """Whether Dynamo and Inductor run on this Python and platform."""
    return bool(_attr("torch._dynamo", "is_inductor_supported")())


def compile_disabled() -> bool:
    """``TORCH_COMPILE_DISABLE=1`` (or the config flag): compiled functions would run eagerly."""
    return bool(_attr("torch._dynamo", "config").disable)


def dispatch_mode_active() -> bool:
    """A user ``TorchDispatchMode`` (e.g. a FLOP counter) is on the stack."""
    return _attr("torch.utils._python_dispatch", "_get_current_dispatch_mode")() is not None


def onednn_linear():
    """``torch.ops.mkldnn._linear_pointwise`` (``(x [M, K], w [N, K], b [N] | None, "none", [],
    "") -> x wᵀ + b`` on CPU), or None when this build has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None
