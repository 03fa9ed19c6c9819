"""The one adapter to transformers' Qwen3.5 MoE models: swap their MoE blocks for :class:`MoE`.

``swap_moe_blocks(model)`` replaces every ``Qwen3_5MoeSparseMoeBlock`` by a :class:`MoE` holding
the same tensors under the same names, so the state dict, HF checkpoints and the math are
unchanged (``tests/test_moe_vs_transformers.py``), and the block gains dropless expert
parallelism, exactly-zero gradients for idle experts and per-step router statistics.

transformers' own load-balancing loss must keep working after the swap: with
``output_router_logits=True`` the model collects every layer's router logits through forward
hooks on modules of its router class (``_can_record_outputs``: ``OutputRecorder(
Qwen3_5MoeTopKRouter, index=0)``), installed on the first forward. A router of another class
is invisible to them — the recorded tuple comes back empty and ``load_balancing_loss_func``
fails, or without the flag the aux term silently vanishes. So the swapped block keeps the
model's own router module as its ``gate`` (same parameter, same math as our router: fp32
softmax, top-k, renormalised), and hooks already installed on it keep firing.

The transformers internals relied on are checked first (:func:`check_transformers`): a missing
one raises naming the installed version and the piece.
"""

from __future__ import annotations

import logging

from torch import nn

from moe_parallel.moe import MoE

__all__ = ["TESTED_TRANSFORMERS", "check_transformers", "swap_moe_blocks"]

# The transformers releases this adapter was tested with (the workspace pins the same range).
TESTED_TRANSFORMERS = (">=5.2", "<5.25")
_MODULE = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
_NEEDED = ("Qwen3_5MoeSparseMoeBlock", "Qwen3_5MoeTopKRouter", "Qwen3_5MoePreTrainedModel")
_log = logging.getLogger(__name__)
_warned: set[str] = set()


def check_transformers():
    """The Qwen3.5-MoE modeling module, after checking what this adapter relies on.

    Raises ``ImportError`` naming the installed transformers version and the missing piece when
    a class, the router's recorded output or the block's ``gate`` is not where it was.
    """
    import importlib

    import transformers

    version = transformers.__version__
    try:
        module = importlib.import_module(_MODULE)
    except ImportError as err:
        raise ImportError(f"transformers {version}: no {_MODULE} ({err})") from err
    missing = [name for name in _NEEDED if not hasattr(module, name)]
    if not missing:
        recorders = getattr(module.Qwen3_5MoePreTrainedModel, "_can_record_outputs", {}) or {}
        target = getattr(recorders.get("router_logits"), "target_class", None)
        if target is not module.Qwen3_5MoeTopKRouter:
            missing.append("Qwen3_5MoePreTrainedModel._can_record_outputs['router_logits']")
    if missing:
        raise ImportError(
            f"transformers {version} changed what moe_parallel.swap_moe_blocks relies on "
            f"(tested: transformers{','.join(TESTED_TRANSFORMERS)}): missing {missing} in {_MODULE}"
        )
    _warn_untested(version)
    return module


def _warn_untested(version: str) -> None:
    from packaging.specifiers import SpecifierSet

    if version not in SpecifierSet(",".join(TESTED_TRANSFORMERS)) and version not in _warned:
        _warned.add(version)
        _log.warning(
            "transformers %s is outside the tested range %s; its internals checked out",
            version,
            ",".join(TESTED_TRANSFORMERS),
        )


def swap_moe_blocks(model: nn.Module, *, expert_backend: str = "auto") -> list[str]:
    """Replace every transformers ``Qwen3_5MoeSparseMoeBlock`` of ``model`` by an equal :class:`MoE`.

    Each new block is built from the model's (text) config, loads the old block's state dict
    strictly on its device and dtype, and takes over the old block's router module as ``gate``
    (module docstring). Returns the replaced module paths; raises ``ValueError`` if there are
    none (the model is not a Qwen3.5 MoE model).
    """
    hf = check_transformers()
    blocks = [
        (path, m) for path, m in model.named_modules() if isinstance(m, hf.Qwen3_5MoeSparseMoeBlock)
    ]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no Qwen3_5MoeSparseMoeBlock to replace")
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config to build the MoE blocks from")
    swapped = []
    for path, block in blocks:
        ours = MoE.from_config(config, expert_backend=expert_backend)
        reference = next(block.parameters())
        ours.to(device=reference.device, dtype=reference.dtype)
        ours.load_state_dict(block.state_dict(), strict=True)
        ours.gate = block.gate
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, ours)
        swapped.append(path)
    return swapped
