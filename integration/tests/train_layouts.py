"""The layouts test_train_dp.py and test_train_compiled.py train against one process: each
layout's overrides, the one-process reference variant it is compared with, the world sizes it
runs at, and how closely it must agree (as data: one table the launch fixtures read)."""

from __future__ import annotations

from dist_checks import FIELDS

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
    # MTP head, against one eager process: CP 2 x EP 2 with FSDP2 over the two CP ranks (the
    # blocks see the same local tensors under DP x CP x EP; dp_x_cp2_ep2 runs that layout eagerly
    # at world 4, where four ranks compiling on two cores cost 200 s)
    "compiled_cp2_ep2": (
        (
            "parallel.dp=1",
            "parallel.cp=2",
            "parallel.ep=2",
            "data.samples_per_rank=4",
            "train.activation_checkpointing=true",
            "train.compile=true",
            *MTP_ON,
        ),
        "mtp",
        (2,),
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
RESUMED_AT_2 = (
    "cross_backend_resume",
    "pp_padding",
    "runs_release",
)  # the checks at world 2 only besides LAYOUTS
# the layouts that compile their blocks (Inductor's CPU code generation: minutes on a cold
# cache), launched on their own (test_train_compiled.py) so that the suite's two workers share
# them with the rest
COMPILED = ("compiled_cp2_ep2", "compiled_tp2", "async_tp2", "megatron_cp2_ac")

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


# train.deterministic: the tiny recipe as it is, run twice, and again with activation
# checkpointing and accumulation (test_determinism.py: one process, with loader workers, which
# these daemonic ranks cannot start)
REPEATS = {
    "repeat_tiny": (),
    "repeat_ac_accum": ("train.activation_checkpointing=true", "train.grad_accum_steps=2"),
}
