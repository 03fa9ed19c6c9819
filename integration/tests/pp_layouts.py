"""The pipeline-parallel layouts test_train_dp.py trains against one process (as
train_layouts.py's table: overrides, reference variant, world sizes), their one-process
variants and how closely they must agree."""

from __future__ import annotations

from dist_checks import FIELDS
from train_layouts import LORA

__all__ = ["PP_COMPARE", "PP_EXPORTED", "PP_LAYOUTS", "PP_RESUMED", "PP_VARIANTS"]

# pipeline parallelism: packed rows of one fixed capacity, 2 micro-batches per step
PP_ROWS = ("data.packing=true", "data.pack_length=256", "train.grad_accum_steps=2")
PP2 = ("parallel.dp={half}", "parallel.pp=2", "data.samples_per_rank={rows}", *PP_ROWS)
PP_MTP = (*PP_ROWS, "model.mtp_layers=1")
PP_LORA = (*PP_ROWS, *LORA, "model.lora.train_modules=[mlp.gate, lm_head]")
INTERLEAVED = ("parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2")
ZERO_BUBBLE = ("parallel.pp_schedule=interleaved_zb", "parallel.pp_virtual_stages=2")

PP_LAYOUTS = {
    # PP 2 (1F1B) with checkpointing and the MTP head, over images and packed rows; also
    # stopped and resumed, and resumed from one process's checkpoint (PP_RESUMED)
    "pp2_1f1b_ac": ((*PP2, *PP_MTP, "train.activation_checkpointing=true"), "pp_mtp", (2,)),
    # interleaved 1F1B, 2 stages per rank (4 stages of one layer each)
    "pp2_interleaved": ((*PP2, *PP_MTP, *INTERLEAVED), "pp_mtp", (2,)),
    # zero bubble (each backward split: inputs, then weights from the retained graph) with
    # checkpointing (recomputed in both passes) and the MTP head
    "pp2_zb_ac": (
        (*PP2, *PP_MTP, *ZERO_BUBBLE, "train.activation_checkpointing=true"),
        "pp_mtp",
        (2,),
    ),
    # LoRA with the routers and lm_head trained in full, GPipe
    "pp2_lora_gpipe": ((*PP2, *PP_LORA, "parallel.pp_schedule=gpipe"), "pp_lora", (2,)),
    # PP 2 x DP 2 (FSDP2 per stage) x EP 2, interleaved (the aux loss is per
    # micro-batch, whose rows differ with DP: compared without it, as the accumulating layouts)
    # PP 2 x CP 2 x EP 2 with checkpointing and the MTP head: each stage's row over 2 CP ranks
    "pp2_cp2_ep2_ac": (
        (
            "parallel.dp=1",
            "parallel.pp=2",
            "parallel.cp=2",
            "parallel.ep=2",
            "data.samples_per_rank=4",
            *PP_MTP,
            "train.activation_checkpointing=true",
        ),
        "pp_mtp",
        (4,),
    ),
    # PP 2 x TP 2 with SP, checkpointing and the MTP head: each TP rank's slice between stages
    "pp2_tp2_sp_ac": (
        (
            "parallel.dp=1",
            "parallel.pp=2",
            "parallel.tp=2",
            "data.samples_per_rank=4",
            *PP_MTP,
            "train.activation_checkpointing=true",
        ),
        "pp_mtp",
        (4,),
    ),
    "pp2_dp2_ep2_interleaved": (
        (*PP2, *PP_MTP, "parallel.ep=2", *INTERLEAVED, "train.router_aux_loss_coef=0"),
        "pp_no_aux",
        (4,),
    ),
    # zero bubble over FSDP2 stages (their units kept unsharded for the weights' pass) with EP
    # and checkpointing
    "pp2_dp2_ep2_zb": (
        (
            *PP2,
            *PP_MTP,
            "parallel.ep=2",
            *ZERO_BUBBLE,
            "train.router_aux_loss_coef=0",
            "train.activation_checkpointing=true",
        ),
        "pp_no_aux",
        (4,),
    ),
    # PP 2 x HSDP 2 (two replicas of each stage, each its own rows), LoRA
    "pp2_hsdp2_lora": (
        (
            "parallel.dp=1",
            "parallel.dp_replicate=2",
            "parallel.pp=2",
            "data.samples_per_rank=2",
            *PP_LORA,
            "train.router_aux_loss_coef=0",
        ),
        "pp_lora_no_aux",
        (4,),
    ),
}
PP_RESUMED = {"pp2_1f1b_ac"}
# evaluated every step and exported at the end (pp_checks.check_pipeline_eval_and_export): the
# merged model with the MTP head, and a LoRA run's PEFT adapter folder (its routers and lm_head
# trained in full, as modules_to_save)
EVALUATED = ("train.eval_every=1",)
PP_EXPORTED = {
    "pp2_eval_export": ((*PP2, *PP_MTP, *EVALUATED), "pp_mtp_eval", (2,)),
    "pp2_lora_eval_export": ((*PP2, *PP_LORA, *EVALUATED), "pp_lora_eval", (2,)),
}
PP_LAYOUTS.update(PP_EXPORTED)
PP_VARIANTS = {
    "pp_mtp": PP_MTP,
    "pp_lora": PP_LORA,
    "pp_mtp_eval": (*PP_MTP, *EVALUATED),
    "pp_lora_eval": (*PP_LORA, *EVALUATED),
    "pp_no_aux": (*PP_MTP, "train.router_aux_loss_coef=0"),
    "pp_lora_no_aux": (*PP_LORA, "train.router_aux_loss_coef=0"),
}
EVAL_FIELDS = ("eval_loss", "eval_accuracy")
PP_COMPARE = {
    "pp_mtp": {"fields": (*FIELDS, "mtp_loss")},
    "pp_mtp_eval": {"fields": (*FIELDS, "mtp_loss", *EVAL_FIELDS, "eval_mtp_accuracy")},
    "pp_lora_eval": {"fields": (*FIELDS, *EVAL_FIELDS)},
    "pp_no_aux": {"fields": ("loss", "ce", "grad_norm", "mtp_loss")},
    "pp_lora_no_aux": {"fields": ("loss", "ce", "grad_norm")},
}
