"""The planner: the public sizes' recipes on fake worlds of 16 to 256 ranks, the terms beyond the
counted tensors, its verdicts and refusals, its processes, and its exact byte counts against
real runs of the same layouts (gloo: every world-4 measurement in one launch)."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist
from dist_checks import measured_state_bytes, saved_activation_bytes
from helpers import ONE_PROCESS, SYNTHETIC, TINY

from dist_testkit import named_check, run_checks
from qwen35_trainer import load_recipe
from qwen35_trainer.cli import main
from qwen35_trainer.model.config import build_config
from qwen35_trainer.plan import plan
from qwen35_trainer.plan.memory import loss_chunk_bytes
from qwen35_trainer.plan.planner import rank_processes, row_shape

# world-4 layouts of the tiny recipe: its own (DP 2 x CP 2 with EP 2) and TP 2 x EP 2 in bf16
SMALL = {
    "tiny": (),
    "tp2_ep2_bf16": (
        "parallel.dp=2",
        "parallel.cp=1",
        "parallel.tp=2",
        "parallel.ep=2",
        "train.dtype=bfloat16",
        "data.samples_per_rank=2",
    ),
    # LoRA in bf16 on the tiny recipe's layout: the frozen base stored in bf16, gradients and
    # optimizer state of the adapters only
    "lora_bf16": ("model.lora.rank=4", "model.lora.expert_rank=8", "train.dtype=bfloat16"),
    # the same with the base quantized on load to FP8: one byte per element plus fp32 scales
    "lora_fp8_bf16": (
        "model.lora.rank=4",
        "model.lora.expert_rank=8",
        "train.dtype=bfloat16",
        "model.base_dtype=fp8",
        "model.fp8_block=[16, 16]",
    ),
    # PP 2 x DP 2 with EP 2 (each stage's ranks hold its layers only)
    "pp2_dp2_ep2": (
        "parallel.pp=2",
        "parallel.cp=1",
        "data.samples_per_rank=2",
        "data.packing=true",
        "data.pack_length=256",
        "train.grad_accum_steps=2",
        "train.eval_every=0",
    ),
}


# the built-in recipes of the public sizes: world, layout, total and active parameters and
# the multi-token-prediction head's (B; the totals include the head, one layer in each)
LARGE = {
    "qwen3_5_35b_a3b": (16, {"dp": 2, "cp": 8, "ep": 8}, 35.95, 3.97, 0.84),
    "qwen3_5_122b_a10b_128k": (128, {"dp": 4, "cp": 32, "ep": 8}, 125.09, 10.41, 2.52),
    "qwen3_5_397b_a17b": (256, {"dp": 8, "cp": 32, "ep": 32}, 403.40, 18.08, 6.60),
}


@pytest.mark.parametrize("name", LARGE)
def test_each_public_size_fits_gpus_of_80_gib_with_the_headroom(name, tmp_path, capsys):
    world, layout, total, active, mtp = LARGE[name]
    out = tmp_path / "plan.json"
    assert main(["plan", name, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "fits in 80 GiB" in table
    assert "images: planned" not in table  # the synthetic stream: its images are the grids
    for term in (
        "cuda context",
        "cuBLAS workspaces",
        "NCCL buffers (5 groups)",
        "allocator reserve",
    ):
        assert f"\n  {term} " in table, term
    result = json.loads(out.read_text())
    assert result["world"] == world and set(result["ranks"]) == {"0", str(world - 1)}
    assert result["layout"] == {"pp": 1, "dp_replicate": 1, "tp": 1, **layout}
    assert abs(result["total_parameters"] / 1e9 - total) < 0.01
    assert abs(result["active_parameters"] / 1e9 - active) < 0.01
    assert abs(result["mtp_parameters"] / 1e9 - mtp) < 0.01
    assert "of which the MTP head" in table
    headroom = result["headroom_gib"]
    # the reserve covers what a step allocates and frees, not parameters and optimizer state
    ranks = result["ranks"].values()
    transient = max(m["peak"] - m["parameters"] - m["optimizer"] for m in ranks) / 2**30
    assert result["transient_gib"] == pytest.approx(transient)
    assert headroom["allocator reserve"] == pytest.approx(1.0 * transient)
    peak = result["counted_peak_gib"] + sum(headroom.values())
    assert result["predicted_peak_gib"] == pytest.approx(peak)
    assert result["fits"] and peak <= 80
    assert all(v > 0 for v in result["communication_bytes_per_step"].values())


# the LoRA recipes of the public sizes, their base in bf16 and in FP8: world, layout, and the
# predicted peak (GiB; README)
LORA = {
    "qwen3_5_35b_a3b_lora": (4, {"dp": 1, "cp": 4, "ep": 4}, 50.01),
    "qwen3_5_122b_a10b_lora": (8, {"dp": 1, "cp": 8, "ep": 8}, 62.34),
    "qwen3_5_397b_a17b_lora": (32, {"dp": 1, "cp": 32, "ep": 32}, 47.89),
    "qwen3_5_35b_a3b_lora_fp8": (1, {"dp": 1, "cp": 1, "ep": 1}, 79.02),
    "qwen3_5_122b_a10b_lora_fp8": (4, {"dp": 1, "cp": 4, "ep": 4}, 79.06),
    "qwen3_5_397b_a17b_lora_fp8": (8, {"dp": 1, "cp": 8, "ep": 8}, 79.18),
}


@pytest.mark.parametrize("name", LORA)
def test_lora_recipes_fit_on_far_fewer_gpus(name, tmp_path):
    """The frozen base is the parameters' bulk; gradients and optimizer state are the
    adapters' (under a tenth of the base here). An FP8 base holds one byte per element: its
    parameters are half the bf16 base's on the same layout, less the scales' and adapters'
    share; one LoRA process holds no FSDP buffers."""
    world, layout, peak = LORA[name]
    out = tmp_path / "plan.json"
    assert main(["plan", name, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["world"] == world and result["fits"]
    assert result["layout"] == {"pp": 1, "dp_replicate": 1, "tp": 1, **layout}
    assert result["predicted_peak_gib"] == pytest.approx(peak, abs=0.01)
    for terms in result["ranks"].values():
        assert terms["gradients"] < 0.1 * terms["parameters"], terms
        assert (terms["dequantized"] > 0) == name.endswith("_fp8"), terms
        if world == 1:
            assert terms["fsdp_buffers"] == 0, terms


def test_headroom_terms_change_the_verdict_and_the_exit_code(capsys, monkeypatch):
    import dataclasses

    import qwen35_trainer.plan
    from qwen35_trainer.plan import Headroom, format_plan

    planned = plan(load_recipe("tiny"))
    quiet = dataclasses.replace(planned, headroom=Headroom(0, 0, 0, 0))
    assert quiet.peak_gib == quiet.counted_gib < planned.peak_gib
    assert planned.peak_gib - planned.counted_gib == pytest.approx(
        # the defaults, 5 groups at DP2xCP2xEP2, the reserve over what a step frees
        0.75 + 0.25 + 0.5 * 5 + 1.0 * planned.transient_gib
    )
    assert 0 < planned.transient_gib < planned.counted_gib
    small = dataclasses.replace(planned, gpu_memory_gib=2.0)  # the context and NCCL alone
    assert quiet.fits and not small.fits and "does NOT fit in 2 GiB" in format_plan(small)
    # tiny reads the demo dataset: the plan says which of its images it counted
    assert "images: the densest micro-batch (2 packed rows) of the first 256 rows of " in (
        format_plan(planned)
    )
    assert main(["plan", "tiny", "--headroom", "fragmentation=-1"]) == 2
    assert "--headroom 'fragmentation=-1': expected NAME=VALUE" in capsys.readouterr().err

    # the command's verdict: the same counted tensors (the planner already ran above), the
    # GPU memory and headroom the command line gives
    def replanned(recipe, *, name, world_size, gpu_memory_gib, headroom):
        assert (name, world_size) == ("tiny", None)
        return dataclasses.replace(planned, gpu_memory_gib=gpu_memory_gib, headroom=headroom)

    monkeypatch.setattr(qwen35_trainer.plan, "plan", replanned)
    assert main(["plan", "tiny", "--gpu-memory", "0.001"]) == 3
    assert "does NOT fit in 0.001 GiB" in capsys.readouterr().out
    assert main(["plan", "tiny", "--gpu-memory", "80"]) == 0
    assert main(["plan", "tiny", "--gpu-memory", "2", "--headroom", "nccl_gib_per_group=0"]) == 0


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (
            ["--world-size", "5"],
            "--world-size 5 is not a multiple of parallel.pp x dp_replicate x cp x tp",
        ),
        (["--set", "parallel.ep=3"], "ep"),
    ],
)
def test_impossible_layouts_are_refused_with_the_reason(args, reason, capsys):
    assert main(["plan", "tiny", *args]) == 2
    assert reason in capsys.readouterr().err


def _process():
    return os.getpid(), dist.is_initialized()


def test_each_planned_rank_runs_in_a_fresh_process():
    """A planned rank builds meshes on its own fake world, and torch caches meshes per process:
    no process may run two ranks, nor start with a process group (the pool's processes are
    forked from a server that only imported the planner)."""
    with rank_processes(2) as pool:
        ran = [pool.submit(_process).result() for _ in range(3)]
    assert len({pid for pid, _ in ran}) == 3 and os.getpid() not in {pid for pid, _ in ran}
    assert not any(initialized for _, initialized in ran)


# fixed-size documents (2 x 24 text tokens around one 8 x 8 image), so the planner's largest row
# is the row; checkpointing on, as in the large recipe
FIXED = (
    "data.text_tokens=[24, 24]",
    "data.image_grids=[[1, 8, 8]]",
    "train.activation_checkpointing=true",
)


@pytest.fixture(scope="module")
def world4():
    """ONE world-4 launch: each SMALL layout's state bytes after a step, and the saved
    activations of the tiny recipe's own layout (DP 2 x CP 2 with EP 2)."""
    checks = [
        named_check(f"state_{name}", measured_state_bytes, (*SYNTHETIC, *overrides))
        for name, overrides in SMALL.items()
    ]
    checks.append(named_check("saved_dp2_cp2_ep2", saved_activation_bytes, (*SYNTHETIC, *FIXED)))
    return run_checks(checks, 4, timeout=900)


@pytest.mark.parametrize("layout", SMALL)
def test_predicted_state_bytes_equal_a_real_run(layout, world4):
    """Parameters, gradients and optimizer state per rank, and under PP the unsharded fp32
    gradients each stage holds until its reduce-scatter: the planner's counts (ranks 0 and 3;
    under PP 0, 2 and 3) equal what a real one-step run at world 4 holds, byte for byte."""
    predicted = plan(load_recipe(TINY, (*SYNTHETIC, *SMALL[layout]))).ranks
    measured = {value["rank"]: value for value in world4.assert_passed(f"state_{layout}")}
    for rank, mem in predicted.items():
        got = measured[rank]
        assert (mem.parameters, mem.gradients, mem.optimizer, mem.pp_grads) == (
            got["parameters"],
            got["gradients"],
            got["optimizer"],
            got["unsharded_grads"],
        ), (rank, mem, got)
    if layout == "pp2_dp2_ep2":  # each stage's unsharded fp32 gradients until the reduce
        assert all(mem.pp_grads > 0 for mem in predicted.values())
        for rank, mem in predicted.items():  # and every unit unsharded after its backward
            assert mem.fsdp_buffers == measured[rank]["unsharded_params"], (rank, mem)


# world-2 layouts whose saved activations are measured in ONE launch: TP 2 + SP with MTP, and
# PP 2 (1F1B over 2 micro-batches: stage 0 holds both in flight; its tower checkpointed whole)
WORLD2 = {
    "tp2_sp_mtp": (*ONE_PROCESS, "parallel.tp=2", "data.packing=true", "model.mtp_layers=1"),
    "pp2": (
        *ONE_PROCESS,
        "parallel.pp=2",
        "data.packing=true",
        # a micro-batch's row exactly (2 samples of 66 tokens, to a multiple of 8): the planner
        # plans full rows, and the stages compute a row's tokens only (not its padding)
        "data.pack_length=136",
        "data.samples_per_rank=4",
        "train.grad_accum_steps=2",
        "train.eval_every=0",
    ),
}


@pytest.fixture(scope="module")
def world2():
    checks = [
        named_check(f"saved_{name}", saved_activation_bytes, (*SYNTHETIC, *layout, *FIXED))
        for name, layout in WORLD2.items()
    ]
    return run_checks(checks, 2, timeout=300)


@pytest.mark.parametrize(
    ("layout", "world"),
    [
        (ONE_PROCESS, 1),
        ((*ONE_PROCESS, "model.mtp_layers=1"), 1),
        ((), 4),
        (WORLD2["tp2_sp_mtp"], 2),
        (WORLD2["pp2"], 2),
    ],
    ids=["one_process", "one_process_mtp", "dp2_cp2_ep2", "tp2_sp_mtp", "pp2"],
)
def test_predicted_saved_activations_are_within_20_percent(layout, world, request):
    """The forward's saved tensors (saved_tensors_hooks, storages once, parameters excluded)
    against the planner's activations plus the loss's saved fp32 gradients (its ``loss`` line
    without the one-chunk working set). Under PP: stage 0's forward of one micro-batch against
    the planner's stage-0 activations over the 2 micro-batches it holds in flight; its tower is
    checkpointed whole, so the tower blocks' inputs (planned in ``recompute``) are not saved."""
    overrides = (*SYNTHETIC, *layout, *FIXED)
    recipe = load_recipe(TINY, overrides)
    predicted = plan(recipe).ranks
    chunk = loss_chunk_bytes(
        build_config(recipe.model).text_config, row_shape(recipe, recipe.parallel.cp)
    )
    in_flight = 2 if "parallel.pp=2" in layout else 1
    if world == 1:
        values = [saved_activation_bytes(overrides)]
    elif world == 4:  # the tiny recipe's own layout: measured in the world-4 launch
        assert overrides == (*SYNTHETIC, *FIXED)
        values = request.getfixturevalue("world4").assert_passed("saved_dp2_cp2_ep2")
    else:
        name = next(n for n, o in WORLD2.items() if o == layout)
        values = request.getfixturevalue("world2").assert_passed(f"saved_{name}")
    measured = {value["rank"]: value for value in values}
    for rank, mem in predicted.items():
        expected = (mem.activations + mem.loss - chunk * bool(mem.loss)) / in_flight
        got = measured[rank]["saved"]
        if got is None:  # a rank without the first stage (PP): not measured
            continue
        assert abs(expected - got) <= 0.2 * got, (rank, expected, got)
    assert any(v["saved"] is not None for v in values)


def test_the_sizes_table_sets_out_each_recipe(monkeypatch, capsys):
    """``qwen35-train plan --sizes``: one row per public size, a cell per way to fine-tune with
    the recipe's GPUs, layout, rows, predicted peak and tokens/s/GPU on the H100 (each recipe's
    numbers are pinned above; a stand-in planner and timer here)."""
    import types

    from qwen35_trainer.plan import sizes
    from qwen35_trainer.plan.planner import Plan

    planned, timed = [], []

    def stand_in(recipe, *, name):
        planned.append(name)
        p = recipe.parallel
        layout = {k: getattr(p, k) for k in ("dp_replicate", "dp", "cp", "tp", "ep")}
        return Plan(name, p.world, layout, 0, 0, {}, {}, 80.0)

    def timer(plan, gpu):
        timed.append(gpu.name)
        return types.SimpleNamespace(tokens_per_gpu=1000.0 * plan.world)

    # a peak read off the name's length, so each cell shows its own recipe's plan
    monkeypatch.setattr(Plan, "peak_gib", property(lambda self: float(len(self.recipe_name))))
    monkeypatch.setattr(sizes, "plan", stand_in)
    monkeypatch.setattr(sizes, "step_time", timer)
    assert main(["plan", "--sizes"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| model | full fine-tuning | LoRA, bf16 base | LoRA, FP8 base |"
    assert planned == [n for names in sizes.SIZES.values() for n in names]
    assert timed == ["H100 SXM"] * len(planned)
    assert table[2].startswith(
        "| Qwen3.5-35B-A3B | 16 GPUs, DP 2 × CP 8 × EP 8, 64K rows: 15.0 GiB, 16,000 tokens/s/GPU"
    )
    assert (
        "| 1 GPU, 28K rows: 24.0 GiB, 1,000 tokens/s/GPU (`qwen3_5_35b_a3b_lora_fp8`) |"
        in (table[2])
    )
    assert (
        "8 GPUs, CP 8 × EP 8, 16K rows: 26.0 GiB, 8,000 tokens/s/GPU (`qwen3_5_397b_a17b_lora_fp8`)"
        in table[4]
    )
