"""Tensor-parallel linear layers shaped for Inductor's micro-pipeline TP (async TP) fusion.

- :func:`tp_linear` / :class:`TPLinear`: ``F.linear`` / ``nn.Linear`` whose compiled graph is
  ``reshape -> mm -> reshape`` with the bias added afterwards — the pattern the pass matches.
- :func:`swap_tp_linears`: put ``TPLinear`` in place of the Linears a TP plan shards.
- :func:`enable_async_tp`: set the Inductor flag for a TP group, or refuse with the reason;
  :func:`async_tp_refusal`: the reason for a device type, before any group exists.
- :func:`find_fusion_patterns`: the fusion sites of a post-grad graph and their status.
"""

from async_tp_linear.enable import async_tp_refusal, enable_async_tp
from async_tp_linear.linear import TPLinear, tp_linear
from async_tp_linear.patterns import FusionSite, find_fusion_patterns
from async_tp_linear.plan import swap_tp_linears

__version__ = "0.2.0"

__all__ = [
    "FusionSite",
    "TPLinear",
    "__version__",
    "async_tp_refusal",
    "enable_async_tp",
    "find_fusion_patterns",
    "swap_tp_linears",
    "tp_linear",
]
