"""``train.compile``: each decoder block and each vision block compiled by ``torch.compile``
(not the whole model: the loss, the embedding merge and the packed-row bookkeeping between the
blocks stay eager, and a block's graph is reused by every block of its kind).

Applied after TP / EP and before activation checkpointing and FSDP2, in place: each block's
``forward`` becomes the compiled forward of its class, bound to the block, so the module keeps
its class, parameters and names (the FSDP units, the checkpoints and the exports are unchanged)
and checkpointing recomputes the same compiled graph.

What is compiled is the class's own ``forward``, not transformers' gradient-checkpointing
wrapper around it (``GradientCheckpointingLayer`` wraps every block class's ``forward`` in one
shared function; the trainer checkpoints with its own wrapper and never turns transformers' on).
Dynamo keeps its graphs, and its limit of 8 recompilations, per code object: through the shared
wrapper the decoder, vision and MTP blocks of both attention kinds all counted against one
limit, which they exceeded, and a block then ran compiled in the forward and eagerly in the
checkpoint's recompute (``CheckpointError``: different saved tensors). Per class, a block
still has one graph per attention kind and per call site (the decoder stack and the MTP head
pass different arguments): up to 7 in the tiny model, so the limit is raised to
:data:`RECOMPILE_LIMIT` (never lowered), leaving room for a model's every variant.

Shapes: without TP a block compiles once for every sequence length (``dynamic=True``: the
packed rows and the vision tower's patch counts vary from step to step). Decoder and MTP layers
split by TP compile for static shapes (``dynamic=False``; the vision tower is not split and
stays dynamic): with a symbolic sequence length, AOTAutograd's trace of the DTensor ops'
backward failed (torch 2.15, CPU: a RecursionError while building the graph node of the
sequence-length symbol for an ``aten.view`` inside DTensor's dispatch; pytorch/pytorch#152954
reports the same recursion), and with static shapes the same run equals one process. A TP run
with ``data.pack_length`` set (every real dataset) has one row length, so one graph; without it
(synthetic data) each new row length compiles once more, within :data:`RECOMPILE_LIMIT`.

Compiling changes no result beyond floating-point reassociation by Inductor's fused kernels:
tests compare compiled runs with eager (one process, with checkpointing) and with one process
(CP 2 x EP 2, and TP 2 with sequence parallelism) over three steps at rel 1e-5. Inside a
block the functions whose Python follows each row's layout or its routed token counts
(cp-varlen-attn's attention and delta rule, moe-parallel's routed experts) run eagerly: they are
excluded from compilation.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

__all__ = ["RECOMPILE_LIMIT", "compile_blocks"]

_CONTAINERS = ("layers", "blocks")  # decoder and MTP layers, vision blocks
RECOMPILE_LIMIT = 64


def compile_blocks(model: nn.Module, *, tp_split: bool = False) -> list[str]:
    """Compile every block of the model's ``layers`` / ``blocks`` containers (decoder layers,
    vision blocks, MTP layers) in place; their paths. ``tp_split``: the decoder and MTP layers
    are split by TP (compiled for static shapes)."""
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
    compiled_forward: dict[type, object] = {}  # one compiled function per block class
    paths = []
    for name, module in model.named_modules():
        container = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.ModuleList) and container in _CONTAINERS:
            dynamic = not (tp_split and container == "layers")
            for i, block in enumerate(module):
                cls = type(block)
                if getattr(block, "gradient_checkpointing", False):
                    raise ValueError(
                        f"{name}.{i}: transformers' gradient checkpointing is on; the trainer "
                        "checkpoints blocks itself (train.activation_checkpointing)"
                    )
                if cls not in compiled_forward:
                    forward = inspect.unwrap(cls.forward)
                    compiled_forward[cls] = torch.compile(forward, dynamic=dynamic)
                block.forward = types.MethodType(compiled_forward[cls], block)
                paths.append(f"{name}.{i}")
    return paths
