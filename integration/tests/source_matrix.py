"""The parity matrix of weight sources × layouts (test_train_matrix.py's launches run it): every
layout starts from every kind of folder a user brings and equals ONE process started from the
same folder over 3 steps (loss, CE, aux, gradient norm at rel 1e-5 in fp32, every trained
parameter).

Sources (``{...}`` filled by the launch fixture with the folders test_train_matrix.py writes):

- ``hf``: a transformers ``save_pretrained`` folder — bf16, the experts per expert, one file,
  no MTP head (transformers' model has none);
- ``dcp``: the same model's state dict as ``torch.distributed.checkpoint.save`` writes it (a
  DCP-based trainer's weights: the experts stacked), its config given by the recipe
  (``model.weights``);
- ``fp8_lora``: a folder in Qwen's FP8 release format (float8 weights with block scales, the
  MTP head's too) trained with LoRA on its frozen FP8 base;
- ``export``: this trainer's own export — sharded safetensors with an index, the experts
  stacked, the MTP head per expert;
- ``resume``: a training checkpoint (one process stopped after step 1, the MTP head trained):
  each layout resumes from its own copy and runs steps 2..3;
- ``lora_init``: LoRA on the ``export`` folder started from a PEFT adapter folder
  (``model.lora.init_from``: this trainer's PEFT export of a one-step LoRA run, the routers and
  ``lm_head`` saved in full).

Layouts: DP 2 · EP 2, CP 2 · EP 2, TP 2 + SP, PP 2 (world 2); PP 2 × CP 2 · EP 2, HSDP (2
replicas × 2 shards) (world 4); the one-process runs are the references (and the ``export``
folder, which holds the seeded weights, must train exactly as the seeded run:
test_train_matrix.py's ``matrix_references``). The rows are packed (PP and CP need it); the
pipeline layouts take 2 micro-batches per step, against one process that does too; the others
one, so every micro-batch holds the same rows as the reference's and the aux loss is compared
too.

:data:`REFUSED`: the pairs the trainer refuses before any worker starts, with the reason
(README "Layouts"); test_train_matrix.py checks each refusal's message.
"""

from __future__ import annotations

from dist_checks import FIELDS
from train_layouts import LORA

__all__ = ["MATRIX_LAYOUTS", "MATRIX_SOURCES", "REFUSED", "ROWS", "cells"]

ROWS = ("data.packing=true", "data.pack_length=256")
PIPELINE = ("parallel.pp=2", "train.grad_accum_steps=2")

# source -> its overrides
MATRIX_SOURCES = {
    "hf": ("model.path={hf}", "model.mtp_layers=0"),
    "dcp": ("model.weights={dcp}", "model.mtp_layers=0"),
    "fp8_lora": ("model.path={fp8}", *LORA, "model.lora.rank=8", "model.mtp_layers=1"),
    "export": ("model.path={export}", "model.mtp_layers=1"),
    "resume": ("model.mtp_layers=1", "train.checkpoint_dir={resume}"),
    "lora_init": (
        "model.path={export}",
        "model.mtp_layers=1",
        *LORA,
        "model.lora.train_modules=[mlp.gate, lm_head]",
        "model.lora.init_from={adapter}",
    ),
}

# layout -> (overrides, micro-batches per step of its reference, world sizes)
MATRIX_LAYOUTS = {
    "dp2_ep2": (("parallel.ep=2",), 1, (2,)),
    "cp2_ep2": (
        ("parallel.dp=1", "parallel.cp=2", "parallel.ep=2", "data.samples_per_rank=4"),
        1,
        (2,),
    ),
    "tp2_sp": (("parallel.dp=1", "parallel.tp=2", "data.samples_per_rank=4"), 1, (2,)),
    "pp2": (("parallel.dp=1", *PIPELINE, "data.samples_per_rank=4"), 2, (2,)),
    "pp2_cp2_ep2": (
        (
            "parallel.dp=1",
            *PIPELINE,
            "parallel.cp=2",
            "parallel.ep=2",
            "data.samples_per_rank=4",
        ),
        2,
        (4,),
    ),
    "hsdp": (
        ("parallel.dp_replicate=2", "parallel.dp=2", "data.samples_per_rank=1"),
        1,
        (4,),
    ),
}

# (layout, source) -> the refusal's message (a substring)
REFUSED = {
    ("tp2_sp", "fp8_lora"): "(model.base_dtype=fp8, or LoRA on an FP8 checkpoint) with "
    "parallel.tp > 1 is not built yet",
}

# the fields compared: the MTP head's loss too where the source has one
COMPARE = {
    "hf": {"fields": FIELDS},
    "dcp": {"fields": FIELDS},
    "fp8_lora": {"fields": (*FIELDS, "mtp_loss")},
    "export": {"fields": (*FIELDS, "mtp_loss")},
    "resume": {"fields": (*FIELDS, "mtp_loss")},
    "lora_init": {"fields": (*FIELDS, "mtp_loss")},
}


def cells(world: int) -> list[tuple[str, str]]:
    """The ``(layout, source)`` pairs a launch of ``world`` ranks runs."""
    return [
        (layout, source)
        for layout, (_, _, worlds) in MATRIX_LAYOUTS.items()
        if world in worlds
        for source in MATRIX_SOURCES
        if (layout, source) not in REFUSED
    ]
