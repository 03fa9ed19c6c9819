"""Activation checkpointing of decoder blocks (and, under EP, of a trainable vision tower).

Layer containers are found by structure: every ``nn.ModuleList`` named ``layers`` or ``blocks``;
it belongs to the vision tower when a component of its path names one (``visual``, ``vision*``),
else to the language model. This covers transformers' Qwen3.5 (``model.language_model.layers``,
``model.visual.blocks``) and models that follow the same naming. Each block is wrapped with
non-reentrant ``torch.utils.checkpoint`` and ``preserve_rng_state=True`` (dropout / DropPath
recompute draws the same numbers).

Why recompute equals the forward: besides RNG, attention output depends on two pieces of ambient
state — the enabled SDPA backend set and the ``F.scaled_dot_product_attention`` callable (context
parallelism patches it). Backward usually runs outside the ``sdpa_kernel`` / patch context of
the forward, on the autograd thread. The ``context_fn`` captures both when the block runs forward
and restores them around the recompute, in plain closures (not ``ContextVar``s, which the
autograd thread would not see).

With EP > 1 the MoE path of the language blocks holds collectives in the recompute, so a
trainable vision tower is checkpointed too (its blocks are wrapped even when ``"vision"`` is not
in ``scope``); a frozen tower (no parameter requires grad) is never wrapped.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.nn.attention import _cur_sdpa_kernel_backends, sdpa_kernel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from moe_parallel.moe import Experts

__all__ = ["apply_activation_checkpointing", "sdpa_preserving_context"]

_SCOPES = ("language", "vision")
_VISION_WORDS = ("visual", "vision")
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._grouped_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


class _Restored:
    """The forward's SDPA backend set and SDPA callable, restored around a recompute. A class,
    not a generator: a graph backpropagated twice (``retain_graph``; a pipeline's split
    backward, inputs then weights) recomputes a checkpointed block twice, entering the same
    context each time."""

    def __init__(self, backends: list, sdpa) -> None:
        self.backends, self.sdpa = backends, sdpa
        self.entered: list = []

    def __enter__(self) -> None:
        kernel = sdpa_kernel(self.backends)
        self.entered.append((F.scaled_dot_product_attention, kernel))
        F.scaled_dot_product_attention = self.sdpa
        kernel.__enter__()

    def __exit__(self, *exc) -> None:
        current, kernel = self.entered.pop()
        try:
            kernel.__exit__(*exc)
        finally:
            F.scaled_dot_product_attention = current


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def sdpa_preserving_context(selective: bool = False):
    """A ``context_fn`` for ``torch.utils.checkpoint``: (forward ctx, recompute ctx).

    The recompute ctx re-enters the SDPA backend set and SDPA callable seen at forward. With
    ``selective=True`` matmul / attention outputs are saved and only the cheap ops recompute.
    """
    backends = _cur_sdpa_kernel_backends()
    sdpa = F.scaled_dot_product_attention
    if not selective:
        return contextlib.nullcontext(), _Restored(backends, sdpa)
    forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(_save_matmuls)
    return forward_ctx, _nested(_Restored(backends, sdpa), recompute_ctx)


@contextlib.contextmanager
def _nested(outer, inner) -> Iterator[None]:
    with outer, inner:
        yield


def _ep_size(model: nn.Module) -> int:
    sizes = [
        torch.distributed.get_world_size(m.ep_group)
        for m in model.modules()
        if isinstance(m, Experts) and m.ep_group is not None
    ]
    return max(sizes, default=1)


def _containers(model: nn.Module) -> list[tuple[str, str, nn.Module, nn.ModuleList]]:
    modules = dict(model.named_modules())
    found = []
    for name, module in modules.items():
        parts = name.split(".") if name else []
        if (
            not isinstance(module, nn.ModuleList)
            or not parts
            or parts[-1] not in ("layers", "blocks")
        ):
            continue
        tower = "vision" if any(w in p for p in parts for w in _VISION_WORDS) else "language"
        found.append((name, tower, modules[".".join(parts[:-1])], module))
    return found


def apply_activation_checkpointing(
    model: nn.Module, *, scope: Sequence[str] = _SCOPES, selective: bool = False
) -> list[str]:
    """Wrap the blocks of the towers in ``scope`` (plus a trainable vision tower when EP > 1).

    Args:
        model: any module whose blocks live in ``nn.ModuleList``\\ s named ``layers``/``blocks``.
        scope: subset of ``("language", "vision")``.
        selective: save matmul and attention outputs, recompute the rest (op-level SAC).

    Returns:
        Paths of the wrapped blocks.

    Raises:
        ValueError: unknown scope entry, or nothing to wrap in the requested scope.
    """
    scope = tuple(scope)
    unknown = [s for s in scope if s not in _SCOPES]
    if unknown or not scope:
        raise ValueError(f"scope must be a non-empty subset of {_SCOPES}, got {scope}")
    wanted = set(scope) | ({"vision"} if _ep_size(model) > 1 else set())
    context_fn = functools.partial(sdpa_preserving_context, selective)
    wrapped = []
    for name, tower, owner, blocks in _containers(model):
        if tower not in wanted:
            continue
        if not any(p.requires_grad for p in owner.parameters()):
            continue
        for i, block in enumerate(blocks):
            # a block without parameters (a pipeline stage's placeholder for a block another
            # stage holds) computes nothing to recompute
            if isinstance(block, CheckpointWrapper) or next(block.parameters(), None) is None:
                continue
            blocks[i] = checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=True)
            wrapped.append(f"{name}.{i}")
    if not wrapped and not any(t in scope for _, t, _, _ in _containers(model)):
        raise ValueError(
            f"no 'layers'/'blocks' container for scope {scope} in {type(model).__name__}"
        )
    return wrapped
