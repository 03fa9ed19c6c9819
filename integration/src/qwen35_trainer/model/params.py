"""A parameter's name as transformers' state dict spells it, whatever wraps its module."""

from __future__ import annotations

from torch import nn

__all__ = ["canonical_name", "named_parameters"]

# what activation checkpointing and torch.compile insert into module paths
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A parameter's name in the transformers state dict (wrapper prefixes removed)."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def named_parameters(model: nn.Module):
    """``(canonical name, module, attribute, parameter)`` for every parameter, in module
    order."""
    for path, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            yield canonical_name(f"{path}.{attr}" if path else attr), module, attr, param
