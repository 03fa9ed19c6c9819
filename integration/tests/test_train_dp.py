"""Every parallel layout takes the same steps as one process (gloo, world 2 and 4).

The reference runs here, in one process, on the global batch (``dp=1`` with all the rows);
each rank of a launch trains its share under a layout and compares with it, one launch per
world size for all layouts. At world 4 each rank holds one row and the smallest parameters
leave some ranks with empty local shards. Layouts: FSDP2 data parallelism; EP 2 (experts split
over pairs of ranks, dense parameters over all, experts FSDP-sharded over the rest); EP = world
with activation checkpointing of decoder and vision blocks and packed rows (the reference is
right-padded); CP = world (one packed row split over every rank by its balanced document
layout) with activation checkpointing; DP x CP 2 with the experts split over the CP ranks;
DP x TP 2 (attention heads and shared expert split) on packed rows. Every TP layout runs with
sequence parallelism (the default with tp > 1: TP 2, DP 2 x TP 2 with checkpointing, TP 2 x CP 2,
DP 2 x TP 2 x EP 2 with accumulation, bf16 TP 2) except TP 2 x EP 2, which keeps the replicated
residual stream (``parallel.sequence_parallel=false``). DP 2 x CP 2 x EP 2 and TP 2 also run with every
block compiled (``train.compile``, with checkpointing); TP 2 also with async TP
(``parallel.async_tp``: Inductor's micro-pipeline TP pass fusing the blocks' collectives into
their matmuls on these CPU ranks, ``dist_testkit.cpu_micro_pipeline_tp``). The packed layouts with TP,
EP = world, CP 2 x EP 2 and bf16 also train the multi-token-prediction head, against one packed
process with it (the token after a CP rank's last position lives on the other rank). Resume: a run stopped after one
step (DCP checkpoint, written synchronously or in the background) and started again continues
exactly, under the same layout and in one process; with the newest checkpoint damaged in one
rank's file, every rank falls back to the one before it. megatron-fsdp
(``parallel.fsdp_backend=megatron``, the real package on these CPU ranks under
``dist_testkit.cpu_cuda_streams``): DP 2 with accumulation, evaluation and export, CP 2 with
checkpointing, compiled blocks and the MTP head, bf16 (also resumed), HSDP (2 replicas x CP 2)
with accumulation (also resumed); a checkpoint written on megatron-fsdp resumes on FSDP2 and the
other way round.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from dist_checks import (
    FIELDS,
    STEPS,
    assert_same_run,
    check_async_tp_equals_one_process,
    check_checkpoints_cross_backends,
    check_megatron_equals_one_process,
    check_resume_equals_uninterrupted,
    check_resume_skips_a_damaged_checkpoint,
    check_runs_repeat,
    check_training_equals_one_process,
    layout_recipe,
)
from fp8_dist_checks import check_fp8_equals_one_process
from fp8_fixtures import export_base, fp8_checkpoint

from dist_testkit import named_check, run_checks
from qwen35_trainer import train

MTP_ON = ("data.packing=true", "model.mtp_layers=1")
# LoRA (model.lora): adapters on every projection and the routed experts (their own rank),
# alpha != rank (a scale of 16, so 3 steps at the tiny recipe's lr learn); everything else frozen
LORA = ("model.lora.rank=4", "model.lora.alpha=64", "model.lora.expert_rank=8")
LORA_TRAIN = "model.lora.train_modules=[mlp.gate, lm_head, mtp]"
# adapters on the FP8 checkpoint written by the ``fp8_base`` fixture (rank 8: on this base the
# rank-4 run with the MTP head does not learn in 3 steps)
FP8_BASE = ("model.path={fp8}", *LORA, "model.lora.rank=8")

# name -> (overrides, reference variant, world sizes). {world}, {half}, {rows}, {export} are
# filled per launch; a reference variant is the one-process run with the same data and options.
LAYOUTS = {
    "fsdp": ((), "base", (2, 4)),
    "ep2": (("parallel.ep=2", "train.export_dir={export}"), "base", (2, 4)),
    # with the multi-token-prediction head (MTP_ON, against one packed process with it): EP = world
    "ep_all_ac_packed": (
        ("parallel.ep={world}", "train.activation_checkpointing=true", *MTP_ON),
        "mtp",
        (2, 4),
    ),
    "cp_all_ac": (
        (
            "parallel.dp=1",
            "parallel.cp={world}",
            "data.samples_per_rank=4",
            "data.packing=true",
            "train.activation_checkpointing=true",
        ),
        "base",
        (2, 4),
    ),
    # with the MTP head and sequence parallelism: TP 2 at world 2, DP 2 x TP 2 with
    # checkpointing at world 4
    "dp_x_tp2_packed": (
        (
            "parallel.dp={half}",
            "parallel.tp=2",
            "data.samples_per_rank={rows}",
            "train.activation_checkpointing={ac}",
            *MTP_ON,
        ),
        "mtp",
        (2, 4),
    ),
    # bf16 TP 2 + SP against one-process bf16 (BF16_COMPARE)
    "bf16_tp2": (
        (
            "parallel.dp=1",
            "parallel.tp=2",
            "data.samples_per_rank=4",
            "train.dtype=bfloat16",
            *MTP_ON,
        ),
        "mtp_bf16",
        (2,),
    ),
    # with the MTP head and checkpointing: CP 2 x EP 2 at world 2 (the token after a rank's last
    # position lives on the other CP rank), DP 2 x CP 2 x EP 2 at world 4
    "dp_x_cp2_ep2": (
        (
            "parallel.dp={half}",
            "parallel.cp=2",
            "parallel.ep=2",
            "data.samples_per_rank={rows}",
            "train.activation_checkpointing=true",
            *MTP_ON,
        ),
        "mtp",
        (2, 4),
    ),
    # train.compile: every decoder, vision and MTP block compiled, with checkpointing and the
    # MTP head, against one eager process
    "compiled_dp2_cp2_ep2": (
        (
            "parallel.dp=2",
            "parallel.cp=2",
            "parallel.ep=2",
            "data.samples_per_rank=2",
            "train.activation_checkpointing=true",
            "train.compile=true",
            *MTP_ON,
        ),
        "mtp",
        (4,),
    ),
    # compiled TP 2 + SP (the decoder and MTP layers compiled for static shapes), with
    # checkpointing and the MTP head
    "compiled_tp2": (
        (
            "parallel.dp=1",
            "parallel.tp=2",
            "data.samples_per_rank=4",
            "train.activation_checkpointing=true",
            "train.compile=true",
            *MTP_ON,
        ),
        "mtp",
        (2,),
    ),
    # parallel.async_tp (compiled TP 2 + SP with checkpointing and the MTP head): Inductor's
    # micro-pipeline TP pass rewrites the blocks' graphs on these CPU ranks, the fused
    # collective-matmul ops running torch's reference kernels (check_async_tp_equals_one_process)
    "async_tp2": (
        (
            "parallel.dp=1",
            "parallel.tp=2",
            "data.samples_per_rank=4",
            "train.activation_checkpointing=true",
            *MTP_ON,
        ),
        "mtp",
        (2,),
    ),
    # EP groups inside one CP group: the 122B shape (EP 8 inside CP 32) in miniature
    "cp4_ep2": (
        (
            "parallel.dp=1",
            "parallel.cp=4",
            "parallel.ep=2",
            "data.samples_per_rank=4",
            "data.packing=true",
        ),
        "base",
        (4,),
    ),
    # one EP group spanning both DP and both CP ranks
    "dp2_cp2_ep4": (
        (
            "parallel.dp=2",
            "parallel.cp=2",
            "parallel.ep=4",
            "data.samples_per_rank=2",
            "data.packing=true",
        ),
        "base",
        (4,),
    ),
    # EP over the DP ranks (ranks with the same CP index)
    "dp2_cp2_ep2_over_dp": (
        (
            "parallel.dp=2",
            "parallel.cp=2",
            "parallel.ep=2",
            "parallel.ep_first=dp",
            "data.samples_per_rank=2",
            "data.packing=true",
        ),
        "base",
        (4,),
    ),
    # with the MTP head
    "tp2_cp2": (
        (
            "parallel.dp=1",
            "parallel.tp=2",
            "parallel.cp=2",
            "data.samples_per_rank=4",
            *MTP_ON,
        ),
        "mtp",
        (4,),
    ),
    # EP over DP with TP, without sequence parallelism: the TP peers dispatch the same tokens
    # in different EP groups
    "tp2_ep2": (
        (
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.ep=2",
            "parallel.sequence_parallel=false",
            "data.samples_per_rank=2",
            "data.packing=true",
        ),
        "base",
        (4,),
    ),
    "hsdp_ep2": (("parallel.dp_replicate=2", "parallel.dp=2", "parallel.ep=2"), "base", (4,)),
    # accumulation: two half batches per step equal one full batch (the aux loss, a product of
    # two batch means, is per micro-batch: off here)
    "accum_dp2_cp2_ep2": (
        (
            "parallel.dp=2",
            "parallel.cp=2",
            "parallel.ep=2",
            "data.samples_per_rank=2",
            "data.packing=true",
            "train.grad_accum_steps=2",
            "train.router_aux_loss_coef=0",
        ),
        "no_aux",
        (4,),
    ),
    "accum_tp2_ep2": (
        (
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.ep=2",
            "data.samples_per_rank=2",
            "data.packing=true",
            "train.grad_accum_steps=2",
            "train.router_aux_loss_coef=0",
        ),
        "no_aux",
        (4,),
    ),
    # text-only rows: DP ranks 2, 3 (padded rows); DP group 1's packed row over its CP ranks
    "fsdp_text_only": (("data.text_only=[4, 2]",), "text_only", (4,)),
    "dp2_cp2_ep2_text_only": (
        (
            "parallel.dp=2",
            "parallel.cp=2",
            "parallel.ep=2",
            "data.samples_per_rank=2",
            "data.packing=true",
            "data.text_only=[4, 2]",
        ),
        "text_only",
        (4,),
    ),
    # LoRA: the adapters sharded with their experts (EP 2); under DP 2 x CP 2 x EP 2 with
    # checkpointing and the (frozen) MTP head, whose loss trains the decoder's adapters
    "lora_ep2": (("parallel.ep=2", *LORA), "lora", (2,)),
    # TP 2 + SP: every adapter split with its projection (tp_lora), the MTP head frozen
    "lora_tp2": (
        ("parallel.dp=1", "parallel.tp=2", "data.samples_per_rank=4", *MTP_ON, *LORA),
        "lora_mtp",
        (2,),
    ),
    "lora_dp2_cp2_ep2": (
        (
            "parallel.dp=2",
            "parallel.cp=2",
            "parallel.ep=2",
            "data.samples_per_rank=2",
            "train.activation_checkpointing=true",
            *MTP_ON,
            *LORA,
        ),
        "lora_mtp",
        (4,),
    ),
    # LoRA with the routers, lm_head and the MTP head trained in full beside the adapters
    "lora_train_dp2_cp2_ep2": (
        (
            "parallel.dp=2",
            "parallel.cp=2",
            "parallel.ep=2",
            "data.samples_per_rank=2",
            *MTP_ON,
            *LORA,
            LORA_TRAIN,
        ),
        "lora_train_mtp",
        (4,),
    ),
    # LoRA on an FP8 checkpoint in Qwen's format (blocks of 12 x 12, partial at every edge;
    # FP8_BASE): in bf16 its experts' FP8 bytes and scales split by EP 2, FSDP gathering the
    # FP8 bytes as stored and casting the adapters (against one bf16 process); in fp32 under DP 2
    # x CP 2 x EP 2 with checkpointing (the recompute dequantizes again) and the MTP head (FP8
    # too)
    "lora_fp8_ep2_bf16": (
        ("parallel.ep=2", *FP8_BASE, "model.mtp_layers=0", "train.dtype=bfloat16"),
        "lora_fp8_bf16",
        (2,),
    ),
    "lora_fp8_dp2_cp2_ep2": (
        (
            "parallel.dp=2",
            "parallel.cp=2",
            "parallel.ep=2",
            "data.samples_per_rank=2",
            "train.activation_checkpointing=true",
            *MTP_ON,
            *FP8_BASE,
        ),
        "lora_fp8_mtp",
        (4,),
    ),
    # bf16 (fp32 master weights and reduction) against one-process bf16, with the MTP head;
    # see BF16_COMPARE
    "bf16_dp2_cp2_ep2": (
        (
            "parallel.dp=2",
            "parallel.cp=2",
            "parallel.ep=2",
            "data.samples_per_rank=2",
            "train.dtype=bfloat16",
            *MTP_ON,
        ),
        "mtp_bf16",
        (4,),
    ),
}

# parallel.fsdp_backend=megatron (every "megatron*" layout; the real megatron-fsdp on the CPU
# ranks, dist_testkit.cpu_cuda_streams), at world 2: data parallel with accumulation, a held-out
# evaluation after every step (its forward puts the compute parameters in place) and the export
# read back below; CP 2 with checkpointing, compiled blocks and the MTP head; bf16 (bf16 weights
# computing over fp32 main weights and gradients) with the MTP head; at world 4: HSDP with
# accumulation
LAYOUTS |= {
    "megatron_fsdp_accum": (
        (
            "train.grad_accum_steps=2",
            "train.router_aux_loss_coef=0",
            "train.eval_every=1",
            "train.export_dir={megatron_export}",
        ),
        "eval_no_aux",
        (2,),
    ),
    "megatron_cp2_ac": (
        (
            "parallel.dp=1",
            "parallel.cp=2",
            "data.samples_per_rank=4",
            "train.activation_checkpointing=true",
            "train.compile=true",
            *MTP_ON,
        ),
        "mtp",
        (2,),
    ),
    "megatron_bf16": (("train.dtype=bfloat16", "train.eval_every=1", *MTP_ON), "mtp_bf16", (2,)),
    # HSDP: 2 replicas of CP 2 shards, two micro-batches per step (the replicas summed once, on
    # the last backward), after the other world-4 layouts in the same ranks (their meshes equal
    # this run's)
    "megatron_hsdp_cp2_accum": (
        (
            "parallel.dp_replicate=2",
            "parallel.dp=1",
            "parallel.cp=2",
            "data.samples_per_rank=2",
            "data.packing=true",
            "train.grad_accum_steps=2",
            "train.router_aux_loss_coef=0",
        ),
        "no_aux",
        (4,),
    ),
}
# megatron layouts also stopped after 1 step and resumed: equal to their own uninterrupted run
# (bf16: the fp32 main weights loaded, then installed into the bf16 weights it computes with;
# each checkpoint written after an evaluation, whose forward put the compute parameters in place;
# HSDP: each shard written once, by one of its replicas, and read by both)
RESUMED = {"megatron_bf16", "megatron_hsdp_cp2_accum"}
RESUMED_AT_2 = ("cross_backend_resume",)  # the checks at world 2 only besides LAYOUTS

VARIANTS = {
    "base": (),
    "no_aux": ("train.router_aux_loss_coef=0",),
    "text_only": ("data.text_only=[4, 2]",),
    "mtp": MTP_ON,
    "mtp_bf16": (*MTP_ON, "train.dtype=bfloat16"),
    "eval_no_aux": ("train.eval_every=1", "train.router_aux_loss_coef=0"),
    "lora": LORA,
    "lora_mtp": (*MTP_ON, *LORA),
    "lora_train_mtp": (*MTP_ON, *LORA, LORA_TRAIN),
    "lora_fp8_bf16": (*FP8_BASE, "model.mtp_layers=0", "train.dtype=bfloat16"),
    "lora_fp8_mtp": (*MTP_ON, *FP8_BASE),
}
# bf16 rounds every matmul input to 8 mantissa bits and the ranks add partial results in another
# order than one process, so the runs agree to bf16 resolution (2^-8 = 0.4 % per rounding), not
# fp32's: 2 % on the logged values, and each parameter tensor's distance to the one-process
# tensor within 2 % of its norm plus one Adam step's (lr per element), not elementwise: Adam
# turns the rounding noise of a near-zero gradient element into an update of up to lr per step,
# in either direction.
BF16_COMPARE = {"rel": 2e-2, "param_norm_rel": 2e-2}
COMPARE = {
    "no_aux": {"fields": ("loss", "ce", "grad_norm")},
    "mtp": {"fields": (*FIELDS, "mtp_loss")},
    "lora_mtp": {"fields": (*FIELDS, "mtp_loss")},
    "lora_fp8_mtp": {"fields": (*FIELDS, "mtp_loss")},
    "lora_train_mtp": {"fields": (*FIELDS, "mtp_loss")},
    # LoRA's B starts at zero: after 3 steps its norm is mostly Adam's updates, each up to lr
    # per element in either direction from bf16 rounding noise, so the per-tensor allowance
    # above (2 % of the norm plus one step's lr) is short of three steps' noise: 5 %
    "lora_fp8_bf16": {**BF16_COMPARE, "param_norm_rel": 5e-2},
    "mtp_bf16": {**BF16_COMPARE, "fields": (*FIELDS, "mtp_loss")},
    "eval_no_aux": {"fields": ("loss", "ce", "grad_norm", "eval_loss", "eval_accuracy")},
}


def _check_of(layout: str):
    """The rank-side check of ``layout``: the megatron-fsdp and async-TP layouts' own, else
    the plain comparison with one process."""
    if layout.startswith("megatron"):
        return check_megatron_equals_one_process
    if layout.startswith("async_tp"):
        return check_async_tp_equals_one_process
    if "fp8" in layout:
        return check_fp8_equals_one_process
    return check_training_equals_one_process


@pytest.fixture(scope="module")
def fp8_base(tmp_path_factory):
    """A tiny checkpoint in Qwen's FP8 format (:func:`fp8_fixtures.fp8_checkpoint`)."""
    root = tmp_path_factory.mktemp("fp8_base")
    return fp8_checkpoint(root / "fp8", export_base(root / "bf16"))


@pytest.fixture(scope="module")
def references(fp8_base):
    """The one-process run of each variant: its step logs and final (fp32) parameters."""
    out = {}
    for name, overrides in VARIANTS.items():
        result = train(layout_recipe(1, *(o.format(fp8=fp8_base) for o in overrides)))
        # one-process bf16 runs FSDP2 on a one-rank group: its DTensors' local part is whole
        state = {k: v.detach().float().clone() for k, v in result.state_dict().items()}
        assert len(result.logs) == STEPS and result.logs[-1].loss < result.logs[0].loss
        out[name] = (result.logs, state)
    return out


@pytest.fixture(scope="module")
def reference(references):
    return references["base"]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def launch(request, references, fp8_base, tmp_path_factory):
    world = request.param
    exported = tmp_path_factory.mktemp(f"export_world{world}")
    megatron_exported = tmp_path_factory.mktemp(f"megatron_export_world{world}")
    fill = {
        "world": world,
        "half": world // 2,
        "rows": 8 // world,
        "export": exported,
        "megatron_export": megatron_exported,
        "ac": str(world == 4).lower(),
        "fp8": fp8_base,
    }
    checks = {
        name: named_check(
            f"{name}@{world}",
            _check_of(name),
            tuple(o.format(**fill) for o in overrides),
            *references[variant],
            COMPARE.get(variant),
            *([str(tmp_path_factory.mktemp(name))] if name in RESUMED else []),
        )
        for name, (overrides, variant, worlds) in LAYOUTS.items()
        if world in worlds
    }
    if world == 2:
        checks["cross_backend_resume"] = named_check(
            "cross_backend_resume@2",
            check_checkpoints_cross_backends,
            str(tmp_path_factory.mktemp("cross_backend")),
            *references["base"],
        )
    saved = tmp_path_factory.mktemp(f"ckpt_world{world}")
    checks["resume"] = named_check(
        f"resume@{world}",
        check_resume_equals_uninterrupted,
        ("parallel.ep=2",),
        str(saved),
        *references["base"],
    )
    checks["resume_async"] = named_check(
        f"resume_async@{world}",
        check_resume_equals_uninterrupted,
        ("parallel.ep=2", "train.async_checkpoint=true"),
        str(tmp_path_factory.mktemp(f"async_ckpt_world{world}")),
        *references["base"],
    )
    checks["resume_damaged"] = named_check(
        f"resume_damaged@{world}",
        check_resume_skips_a_damaged_checkpoint,
        ("parallel.ep=2",),
        str(tmp_path_factory.mktemp(f"damaged_ckpt_world{world}")),
        *references["base"],
    )
    if world == 4:  # a LoRA run stopped and resumed from its adapter checkpoint
        checks["resume_lora"] = named_check(
            "resume_lora@4",
            check_resume_equals_uninterrupted,
            LAYOUTS["lora_dp2_cp2_ep2"][0],
            str(tmp_path_factory.mktemp("lora_ckpt")),
            *references["lora_mtp"],
            COMPARE["lora_mtp"],
        )
    for name, overrides in REPEATS.items():
        if world == 4:  # the tiny recipe's own 4 ranks
            checks[name] = named_check(
                name, check_runs_repeat, str(tmp_path_factory.mktemp(name)), overrides
            )
    report = run_checks(list(checks.values()), world, timeout=900)
    return checks, report, saved, (exported, megatron_exported)


# train.deterministic: the tiny recipe as it is, run twice, and again with activation
# checkpointing and accumulation (test_determinism.py: one process, with loader workers, which
# these daemonic ranks cannot start)
REPEATS = {
    "repeat_tiny": (),
    "repeat_ac_accum": ("train.activation_checkpointing=true", "train.grad_accum_steps=2"),
}


@pytest.mark.parametrize(
    "layout",
    [
        *LAYOUTS,
        "resume",
        "resume_async",
        "resume_damaged",
        "resume_lora",
        "cross_backend_resume",
        *REPEATS,
    ],
)
def test_layout_equals_one_process(launch, layout):
    checks, report, _, _ = launch
    if layout not in checks:
        worlds = LAYOUTS[layout][2] if layout in LAYOUTS else (2 if layout in RESUMED_AT_2 else 4)
        pytest.skip(f"{layout} runs at world {worlds}")
    report.assert_passed(checks[layout])


def test_checkpoint_of_a_sharded_run_resumes_in_one_process(launch, reference, tmp_path):
    """The step-1 checkpoint written by the EP 2 + FSDP2 ranks, resumed by ONE process (DCP
    re-shards on load): steps 2..3 and the final parameters equal the uninterrupted run."""
    checks, report, saved, _ = launch
    report.assert_passed(checks["resume"])
    shutil.copytree(saved / "step_000001", tmp_path / "step_000001")
    result = train(layout_recipe(1, f"train.checkpoint_dir={tmp_path}"))
    state = result.objective.model.state_dict()
    assert_same_run(result.logs, reference[0][1:], state, reference[1])


@pytest.mark.parametrize("layout", ["ep2", "megatron_fsdp_accum"])
def test_export_of_a_sharded_run_loads_in_transformers(launch, references, layout):
    """The EP 2 + FSDP2 layout and the megatron-fsdp one exported their trained model (each
    rank gathering the tensors it writes): transformers' own class loads it, and the weights
    are those of the one-process run of the same recipe."""
    if layout not in launch[0]:
        pytest.skip(f"{layout} runs at world {LAYOUTS[layout][2]}")
    reference = references[LAYOUTS[layout][1]]
    checks, report, _, (fsdp2_export, megatron_export) = launch
    report.assert_passed(checks[layout])
    exported = megatron_export if layout.startswith("megatron") else fsdp2_export
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(exported)
    state = loaded.state_dict()
    lr = layout_recipe(1).train.lr
    for name, value in reference[1].items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-3 * lr)
