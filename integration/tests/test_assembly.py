"""Every package assembled: the kernel each layer kind runs (resolved, reported, refused when a
named one cannot run), compiled blocks equal to eager, and the layouts a machine cannot run
(async TP, megatron-fsdp off CUDA) refused up front with one message. The sequence-parallel
layouts are in ``test_train_dp.py``; the GPU checks in ``test_gpu.py``."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from dist_checks import assert_same_run, layout_recipe
from helpers import ONE_PROCESS, tiny

import cp_varlen_attn.attention
import cp_varlen_attn.gated_delta
from qwen35_trainer import train
from qwen35_trainer.cli import main
from qwen35_trainer.model import kernels
from qwen35_trainer.model.build import build_model
from qwen35_trainer.model.kernels import resolve_kernels
from qwen35_trainer.parallel.compile import compile_blocks
from qwen35_trainer.parallel.dist import init_distributed
from qwen35_trainer.parallel.megatron import megatron_refusals
from qwen35_trainer.parallel.requirements import machine_refusals
from qwen35_trainer.plan import plan
from qwen35_trainer.supervise.console import what_runs


def test_the_kernel_report_on_cpu_names_the_torch_paths():
    chosen = resolve_kernels(tiny(), "cpu")
    assert chosen.record() == {
        "attention": "torch",
        "gated delta rule": "torch",
        "experts": "torch",
        "optimizer": "adamw",
    }
    assert chosen.line() == (
        "kernels: attention torch SDPA per document piece (torch), gated delta rule torch "
        "chunked rule (torch), experts torch grouped mm (torch), optimizer torch AdamW (adamw)"
    )
    assert chosen.fallbacks == ()  # CPU: the torch paths are the only ones


def test_with_the_gpu_packages_present_auto_picks_them_and_the_report_says_so(monkeypatch):
    monkeypatch.setattr(cp_varlen_attn.attention, "_flash_available", lambda: True)
    monkeypatch.setattr(cp_varlen_attn.gated_delta, "_fla_available", lambda: True)
    monkeypatch.setattr(kernels, "_te_available", lambda: True)
    chosen = resolve_kernels(tiny("train.optimizer=auto", "train.dtype=bfloat16"), "cuda")
    assert chosen.record() == {
        "attention": "flash",
        "gated delta rule": "fla",
        "experts": "te",
        "optimizer": "te_fused_adam",
    }
    assert "attention flash-attn varlen (flash)" in chosen.line() and chosen.fallbacks == ()
    # a named torch path is what the user asked for: no warning
    named = resolve_kernels(tiny("model.attention_backend=torch"), "cuda")
    assert named.record()["attention"] == "torch" and named.fallbacks == ()


def test_auto_falling_back_on_cuda_warns_naming_the_package(monkeypatch):
    """The wheel-only install (no flash-attn, no TransformerEngine): in bf16 attention runs
    torch's varlen_attn, the experts torch's grouped mm and AdamW torch's fused kernel, none a
    fallback; the two slow paths warn: fp32 attention (the per-piece SDPA loop) and the torch
    GDN rule without fla."""
    monkeypatch.setattr(cp_varlen_attn.attention, "_flash_available", lambda: False)
    monkeypatch.setattr(cp_varlen_attn.gated_delta, "_fla_available", lambda: False)
    monkeypatch.setattr(kernels, "_te_available", lambda: False)
    chosen = resolve_kernels(tiny("train.optimizer=auto", "train.dtype=bfloat16"), "cuda")
    assert chosen.record() == {
        "attention": "torch_varlen",
        "gated delta rule": "torch",
        "experts": "torch",
        "optimizer": "adamw",
    }
    assert "attention torch varlen_attn (torch_varlen)" in chosen.line()
    assert len(chosen.fallbacks) == 1 and "install flash-linear-attention" in chosen.fallbacks[0]
    chosen = resolve_kernels(tiny("train.optimizer=auto"), "cuda")  # fp32
    assert chosen.record()["attention"] == "torch"
    assert len(chosen.fallbacks) == 2
    assert "torch SDPA per document piece (slow): train.dtype=float32" in chosen.fallbacks[0]


def test_a_named_backend_that_cannot_run_is_one_clear_error(capsys):
    with pytest.raises(ValueError, match=r"model.attention_backend=flash: backend='flash' needs"):
        resolve_kernels(tiny("model.attention_backend=flash"), "cpu")
    one = ("--set", "parallel.dp=1", "--set", "parallel.cp=1", "--set", "parallel.ep=1")
    assert (
        main(["tiny", *one, "--set", "model.gdn_backend=fla", "--set", "model.expert_backend=te"])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("qwen35-train:") == 1 and "Traceback" not in err
    assert "model.gdn_backend=fla: backend='fla' needs the flash-linear-attention" in err
    assert "model.expert_backend=te: needs TransformerEngine and a CUDA device" in err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("parallel.tp=2", "parallel.async_tp=true"),
            "parallel.async_tp=true: async TP needs a CUDA (or XPU) mesh with NCCL (XCCL)",
        ),
        (
            ("parallel.tp=2", "parallel.sequence_parallel=false", "parallel.async_tp=true"),
            "parallel.async_tp=true needs sequence parallelism",
        ),
        (
            ("parallel.fsdp_backend=megatron",),
            "parallel.fsdp_backend=megatron needs a CUDA device (this machine has none)",
        ),
        (
            ("parallel.tp=2", "parallel.fsdp_backend=megatron"),
            "parallel.fsdp_backend=megatron runs with parallel.ep=1 and parallel.tp=1",
        ),
        (("parallel.sequence_parallel=true",), "parallel.sequence_parallel=true needs"),
        (
            ("parallel.tp=2", "parallel.cp=8", "data.pack_length=264"),
            "data.pack_length=264 must be a multiple of 16 under sequence parallelism",
        ),
    ],
    ids=[
        "async_tp_on_cpu",
        "async_tp_without_sp",
        "megatron_on_cpu",
        "megatron_with_tp",
        "sp_without_tp",
        "sp_row_length",
    ],
)
def test_layouts_this_machine_cannot_run_are_refused_before_anything_is_built(
    overrides, message, capsys, monkeypatch
):
    """As under torchrun (WORLD_SIZE set, no worker started): every rank runs the same checks on
    the same recipe and machine before any process group exists, so all exit 2 alike."""
    recipe = tiny(*overrides)
    monkeypatch.setenv("WORLD_SIZE", str(recipe.parallel.world))
    argv = ["tiny"] + [a for o in (*ONE_PROCESS, *overrides) for a in ("--set", o)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("qwen35-train:") == 1 and message in err, err
    assert "Traceback" not in err


def test_a_refusal_in_a_process_holding_a_one_rank_group_returns_its_code(capsys, monkeypatch):
    """One process's training keeps its one-rank group for the life of the process
    (:mod:`qwen35_trainer.parallel.dist`); the command run afterwards in that process, even with
    ``WORLD_SIZE`` set, returns its code: only a member of a multi-rank group leaves through
    ``worker_exit`` (which ends the process, here the test run)."""
    init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "4")
    sets = [a for o in (*ONE_PROCESS, "parallel.async_tp=true") for a in ("--set", o)]
    assert main(["tiny", *sets]) == 2
    assert "parallel.async_tp=true" in capsys.readouterr().err


def test_compiled_blocks_equal_eager_in_one_process():
    """``train.compile``: three steps with every decoder, vision and MTP block compiled equal the
    eager run (fp32, rel 1e-5; parameters), with activation checkpointing (the recipes' setting:
    the recompute must run the graph the forward ran)."""
    overrides = ("data.packing=true", "model.mtp_layers=1", "train.activation_checkpointing=true")
    eager = train(layout_recipe(1, *overrides))
    compiled = train(layout_recipe(1, *overrides, "train.compile=true"))

    def state(result):
        return {k: v.detach().float().clone() for k, v in result.state_dict().items()}

    fields = ("loss", "ce", "aux", "grad_norm", "mtp_loss")
    assert_same_run(compiled.logs, eager.logs, state(compiled), state(eager), fields=fields)


def test_the_first_lines_say_how_the_blocks_compile():
    """Under TP the split layers compile for static shapes (``parallel.compile``): the run says
    so, and without ``data.pack_length`` that each new row length compiles again."""

    def said(*overrides):
        recipe = tiny(*overrides)
        lines = what_runs(recipe, 4, torch.device("cpu"), resolve_kernels(recipe, "cpu"))
        return lines[1].split("; compiled blocks ")[1]

    tp = ("parallel.dp=1", "parallel.tp=2", "data.packing=true", "train.compile=true")
    assert said() == "off"
    assert said("train.compile=true") == "on (dynamic shapes)"
    assert said(*tp) == (
        "on (the TP-split layers for static shapes: one graph per row length; set "
        "data.pack_length for one graph)"
    )
    assert said(*tp, "data.pack_length=64") == (
        "on (the TP-split layers for static shapes: one graph per row length)"
    )


def test_compiling_refuses_transformers_own_checkpointing():
    """The compiled forward is the block class's own, inside transformers' checkpointing wrapper:
    a block with that wrapper turned on would silently lose it, so it is an error."""
    model = build_model(tiny().model)
    model.model.language_model.layers[0].gradient_checkpointing = True
    with pytest.raises(ValueError, match=r"layers\.0: transformers' gradient checkpointing"):
        compile_blocks(model)


def test_megatron_with_cuda_and_its_package_runs_what_it_is_proven_on(monkeypatch):
    """Where CUDA and megatron-fsdp are both present the machine refuses nothing; what the
    parity tests do not train on megatron-fsdp is refused, each with its reason, in one
    message (test_train_dp.py trains the rest on CPU ranks)."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "megatron_fsdp" else real_find_spec(name, *a),
    )
    megatron = ("parallel.fsdp_backend=megatron",)
    assert machine_refusals(tiny(*megatron).parallel, cuda=True) == []
    assert megatron_refusals(tiny(*megatron)) == []
    proven = ("train.dtype=bfloat16", "train.checkpoint_dir=/tmp/x", "train.compile=true")
    proven += ("parallel.dp_replicate=2", "parallel.dp=2")
    assert megatron_refusals(tiny(*megatron, *proven)) == []
    unproven = ("parallel.ep=2", "train.checkpoint_dir=/tmp/x", "train.async_checkpoint=true")
    refused = megatron_refusals(tiny(*megatron, *unproven))
    assert len(refused) == 2, refused
    whats = {
        "parallel.ep=1 and parallel.tp=1": "use parallel.fsdp_backend=fsdp2",
        "train.async_checkpoint=true": "set train.async_checkpoint=false",
    }
    for reason, (what, remedy) in zip(refused, whats.items(), strict=True):
        assert what in reason and reason.endswith(remedy), reason
    with pytest.raises(ValueError, match=r"the planner plans parallel\.fsdp_backend=fsdp2"):
        plan(tiny(*megatron))
