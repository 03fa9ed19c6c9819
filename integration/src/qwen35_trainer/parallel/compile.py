"""``train.compile``: each decoder block and each vision block compiled by ``torch.compile``
(not the whole model: the loss, the embedding merge and the packed-row bookkeeping between the
blocks stay eager, and a block's graph is reused by every block of its kind).

Applied after TP / EP and before activation checkpointing and FSDP2 (the order torchtitan uses:
the compiled block is what checkpointing recomputes and what FSDP2 shards), in place
(``nn.Module.compile``: the module keeps its class, parameters and names, so the FSDP units,
the checkpoints and the exports are unchanged). Compiling changes no result beyond floating-point
reassociation by Inductor's fused kernels: a test compares the compiled run with eager over three
steps at rel 1e-5.
"""

from __future__ import annotations

from torch import nn

__all__ = ["compile_blocks"]

_CONTAINERS = ("layers", "blocks")


def compile_blocks(model: nn.Module) -> list[str]:
    """Compile every block of the model's ``layers`` / ``blocks`` containers (decoder layers,
    vision blocks, MTP layers) in place; their paths."""
    compiled = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in _CONTAINERS:
            for i, block in enumerate(module):
                block.compile(dynamic=True)
                compiled.append(f"{name}.{i}")
    return compiled
