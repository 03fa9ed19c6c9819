"""The planner's step-time model: each term of :func:`qwen35_trainer.plan.timing.step_time`
against a hand computation on a small two-stage plan (compute per op class, each overlap rule,
the pipeline's fill and drain, the optimizer, the totals); the compute each rank runs
(:mod:`qwen35_trainer.plan.work`: FLOPs per kind and the passes of full fine-tuning and LoRA);
the traffic per step (:mod:`qwen35_trainer.plan.traffic`); the GPU profiles and the flags."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import SYNTHETIC, TINY

from qwen35_trainer import load_recipe
from qwen35_trainer.cli import main
from qwen35_trainer.model.build import build_meta_model
from qwen35_trainer.model.config import build_config
from qwen35_trainer.model.flops import KINDS, forward_flops, training_flops
from qwen35_trainer.parallel import ParallelDims
from qwen35_trainer.plan import kernel_rates
from qwen35_trainer.plan.hardware import GPUS, Hardware, hardware
from qwen35_trainer.plan.memory import Memory
from qwen35_trainer.plan.nodes import crossing_groups
from qwen35_trainer.plan.planner import Plan, Step, row_shape
from qwen35_trainer.plan.stages import StageView
from qwen35_trainer.plan.timing import Efficiency, step_time
from qwen35_trainer.plan.traffic import communication
from qwen35_trainer.plan.work import Work, rank_work, row_documents, step_model_flops

# round numbers: 1e14 FLOP/s, HBM 2 TB/s, NVLink 100 GB/s, InfiniBand 10 GB/s
GPU = Hardware("test", "test", 100.0, 2.0, 100.0, 10.0, 80.0)
EFF = Efficiency(
    matmul=0.5, head=0.8, grouped=0.25, attention=0.4, recurrence=0.1, nvlink=0.5, ib=0.5, hbm=0.5
)


def _dims(pp=1, d=1, c=1, t=1, e=1) -> ParallelDims:
    p = load_recipe(TINY).parallel
    parallel = dataclasses.replace(p, pp=pp, dp_replicate=1, dp=d, cp=c, tp=t, ep=e)
    return ParallelDims.from_recipe(parallel, pp * d * c * t)


def _work(flops: dict[str, float], passes: dict[str, float], units: int) -> Work:
    return Work(
        {k: flops.get(k, 0.0) for k in KINDS}, {k: passes.get(k, 3.0) for k in KINDS}, units
    )


def _small_plan(schedule="1f1b", virtual=1, async_tp=False) -> Plan:
    """PP 2 x DP 2 on nodes of 2 GPUs: each stage one node (its FSDP and TP inside, NVLink),
    the pipeline's sends across (InfiniBand); rank 0 (stage 0) and rank 2 (stage 1) planned."""
    layout = dict(pp=2, dp_replicate=1, dp=2, cp=1, tp=1, ep=1)
    ranks = {
        0: Memory(0, 10**9, 2 * 10**9, 0, 0, 0, 0, 0, 0),
        2: Memory(0, 2 * 10**9, 4 * 10**9, 0, 0, 0, 0, 0, 0),
    }
    work = {
        0: _work({"attention": 1e12, "experts": 2e12, "vision": 1e12}, {"vision": 3.0}, 4),
        2: _work({"loss": 4e12, "gdn_core": 1e11}, {}, 4),
    }
    traffic = {
        0: {
            "fsdp_all_gather": 5 * 10**9,
            "fsdp_reduce_scatter": 5 * 10**9,
            "ep_all_to_all": 10**9,
            "tp": 10**9,
            "pp_p2p": 10**8,
        },
        2: {"fsdp_all_gather": 40 * 10**9, "fsdp_reduce_scatter": 40 * 10**9, "pp_p2p": 10**8},
    }
    step = Step(4, schedule, virtual, 8192, 1e13, _dims(pp=2, d=2), async_tp)
    return Plan(
        "small", 4, layout, 0, 0, ranks, {}, 80.0, rank_traffic=traffic, work=work, step=step
    )


def test_each_term_against_a_hand_computation():
    """Rank 0: compute per micro-batch 1e12·3/(1e14·0.5) + 2e12·3/(1e14·0.25) + 1e12·3/(1e14·0.5)
    = 0.36 s, 1.44 s over 4; rank 2: 4e12·3/(1e14·0.8) + 1e11·3/(1e14·0.1) = 0.18 s, 0.72 s.
    Links at half their 100 / 10 GB/s: rank 0's FSDP 0.1 + 0.1 s hidden behind its compute but
    one unit of 4 (0.05 s), its all-to-all, TP and send (InfiniBand) 0.02 s each, exposed;
    rank 2's FSDP 0.8 + 0.8 s exceed its 0.72 s: 1.6/4 + 0.88 = 1.28 s exposed. Optimizer
    (3 G + 2 O) / 1 TB/s: 7 ms and 14 ms. Per micro-batch b0 = (1.44 + 0.06)/4 = 0.375, b2 =
    (0.72 + 0.02)/4 = 0.185: step = 4·0.375 + 0.185 + (1.28 + 0.014)."""
    t = step_time(_small_plan(), GPU, EFF, node_gpus=2)
    assert t.compute == pytest.approx(1.44)
    assert t.exposed == pytest.approx(
        {
            "ep_all_to_all": 0.02,
            "fsdp_all_gather": 0.64,
            "fsdp_reduce_scatter": 0.64,
            "pp_p2p": 0.02,
            "tp": 0.02,
        }
    )
    assert t.pipeline_idle == pytest.approx(0.185)
    assert t.optimizer == pytest.approx(0.014)
    seconds = 4 * 0.375 + 0.185 + 1.28 + 0.014
    assert t.seconds == pytest.approx(seconds)
    assert t.tokens_per_gpu == pytest.approx(8192 / seconds / 4)
    assert t.tflops_per_gpu == pytest.approx(1e13 / seconds / 4 / 1e12)
    assert t.mfu == pytest.approx(t.tflops_per_gpu / 100)


def test_the_schedule_and_async_tp_terms():
    """Interleaved zero bubble with 2 stages per rank: the fill and drain over v·3 = 6; async
    TP fuses TP's collectives into the matmuls: none exposed."""
    t = step_time(_small_plan("interleaved_zb", 2, async_tp=True), GPU, EFF, node_gpus=2)
    assert t.pipeline_idle == pytest.approx(0.185 / 6)
    assert t.exposed["tp"] == 0.0
    b0 = (1.44 + 0.04) / 4
    assert t.seconds == pytest.approx(4 * b0 + 0.185 / 6 + 1.28 + 0.014)
    # every group inside one node of 4: the sends over NVLink, 10x faster
    inside = step_time(_small_plan(), GPU, EFF, node_gpus=4)
    assert inside.exposed["pp_p2p"] == pytest.approx(0.002)


def test_without_pipeline_the_step_is_the_micro_batches():
    p = _small_plan()
    one = dataclasses.replace(
        p,
        layout={**p.layout, "pp": 1},
        ranks={0: p.ranks[0]},
        work={0: p.work[0]},
        rank_traffic={0: {"ep_all_to_all": 10**9}},
        step=dataclasses.replace(p.step, dims=_dims(d=4)),
    )
    t = step_time(one, GPU, EFF, node_gpus=4)
    assert t.pipeline_idle == 0.0
    assert t.seconds == pytest.approx(1.44 + 0.02 + 0.007)


def test_tp_groups_spanning_nodes_cross_them():
    assert "tp" in crossing_groups(_dims(d=2, t=4), 2)
    assert "tp" not in crossing_groups(_dims(d=2, t=2), 2)


# the tiny recipe on packed rows: DP 2 x CP 2 with EP 2, 4 samples of a step per group in 2
# micro-batches
PACKED = (*SYNTHETIC, "data.packing=true", "data.pack_length=256", "data.samples_per_rank=4")


def test_rank_work_is_its_share_of_the_model_and_its_passes():
    """Full fine-tuning under activation checkpointing: the decoder kinds run forward,
    recompute and a two-part backward (4), the head and the MTP fc 3, the MTP depth's share of
    the loss recomputed; LoRA without checkpointing: projections forward and the input's
    gradient (2), the cores 3, the frozen tower forward only. The FLOPs: 1/cp of the model's
    kinds over the rank's row (the whole model without PP), the tower's whole frames."""
    checkpointed = ("train.activation_checkpointing=true", "train.grad_accum_steps=2")
    recipe = load_recipe(TINY, [*PACKED, *checkpointed, "model.mtp_layers=1"])
    config = build_config(recipe.model)
    dims = ParallelDims.from_recipe(recipe.parallel, recipe.parallel.world)
    shape = row_shape(recipe, dims.cp)
    whole = StageView(tuple(config.text_config.layer_types), True, True, 1.0, 0, 0)
    work = rank_work(recipe, config, dims, shape, whole)
    data = recipe.data
    grids = [list(max(data.image_grids, key=lambda g: g[0] * g[1] * g[2]))] * (
        2 * data.images_per_sample  # 2 samples per micro-batch
    )
    full = forward_flops(config, row_documents(recipe, shape.row_tokens), grids)
    assert work.forward == pytest.approx({k: v / 2 for k, v in full.items()})
    decoder = ("attention", "attention_core", "gdn", "gdn_core", "shared_expert", "experts")
    assert all(work.passes[k] == 4 for k in (*decoder, "vision", "vision_core"))
    assert work.passes["mtp"] == 3 and work.passes["loss"] == 3.5  # half the loss is MTP's
    lora = load_recipe(TINY, [*PACKED, "model.lora.rank=4", "train.activation_checkpointing=false"])
    passes = rank_work(lora, config, dims, shape, whole).passes
    assert {
        k: passes[k] for k in ("attention", "gdn", "shared_expert", "experts")
    } == dict.fromkeys(("attention", "gdn", "shared_expert", "experts"), 2.0)
    assert passes["attention_core"] == passes["gdn_core"] == 3
    assert passes["vision"] == passes["vision_core"] == 1
    # one image of one frame per micro-batch: CP 2 splits the row, not the frame; the tower's
    # rank runs all of it
    single_image = ("data.samples_per_rank=2", "data.images_per_sample=1")
    one = load_recipe(TINY, [*PACKED, *checkpointed, *single_image, "data.image_grids=[[1, 8, 8]]"])
    single = rank_work(one, config, dims, row_shape(one, dims.cp), whole).forward
    alone = forward_flops(config, row_documents(one, row_shape(one, 2).row_tokens), [[1, 8, 8]])
    assert single["vision"] == pytest.approx(alone["vision"]) and single["vision"] > 0
    assert single["attention"] == pytest.approx(alone["attention"] / 2)
    # a middle pipeline stage: its layers only
    middle = StageView(("linear_attention",), False, False, 1.0, 1, 1)
    only = rank_work(recipe, config, dims, shape, middle).forward
    assert only["loss"] == only["vision"] == only["mtp"] == only["attention"] == 0
    assert only["gdn"] > 0


def test_documents_and_the_steps_model_flops():
    """The synthetic stream's rows hold documents of its mean sample: (images + 1) texts of
    the mean length and each image's merged tokens with its two markers; a dataset's row is one
    document per packed row. The step's model FLOPs: three forwards of every micro-batch's row."""
    recipe = load_recipe(TINY, [*PACKED, "data.text_tokens=[20, 40]"])
    t, h, w = max(recipe.data.image_grids, key=lambda g: g[0] * g[1] * g[2])
    doc = 2 * 30 + t * h * w // 4 + 2
    assert row_documents(recipe, 256) == [doc] * (256 // doc) + [256 % doc] * bool(256 % doc)
    dataset = load_recipe(TINY, ["data.packing=true"])  # the demo dataset's rows
    assert dataset.data.dataset and row_documents(dataset, 256) == [256]
    assert row_documents(dataset, 2 * 256) == [256, 256]
    config = build_config(recipe.model)
    shape = row_shape(recipe, 2)
    m = recipe.train.grad_accum_steps
    grids = [[t, h, w]] * (4 // m * recipe.data.images_per_sample)  # a micro-batch's samples
    per_row = training_flops(config, row_documents(recipe, 256), grids)
    assert step_model_flops(recipe, config, shape) == pytest.approx(per_row * m * 2)


def test_traffic_is_per_step():
    """Per micro-batch kinds times the micro-batches; FSDP per micro-batch, once under PP;
    dispatch and K/V over 3 passes under checkpointing, 2 without; TP's four collectives of
    the rows per layer and pass; no vision gather off the tower's stage."""
    recipe = load_recipe(TINY, PACKED)
    model = build_meta_model(recipe.model)
    dims = ParallelDims.from_recipe(recipe.parallel, 4)
    shape = row_shape(recipe, 2)
    one = communication(model, dims, shape)
    three = communication(model, dims, shape, microbatches=3)
    assert all(three[k] == pytest.approx(3 * v, abs=3) for k, v in one.items())
    piped = communication(model, dims, shape, microbatches=3, pipelined=True, tower=False)
    assert piped["fsdp_all_gather"] == one["fsdp_all_gather"] and piped["vision_gather"] == 0
    assert piped["ep_all_to_all"] == three["ep_all_to_all"]
    plain = communication(model, dims, shape, checkpointing=False)
    assert plain["ep_all_to_all"] == pytest.approx(one["ep_all_to_all"] * 2 / 3, abs=1)
    assert "tp" not in one
    tp = communication(model, _dims(t=2), row_shape(recipe, 1))
    text, one_cp = model.config.text_config, row_shape(recipe, 1)
    rows = len(text.layer_types) * one_cp.tokens * text.hidden_size * one_cp.compute_bytes
    assert tp["tp"] == int(4 * rows * 3 * 0.5)


def test_gpu_profiles_are_the_datasheets():
    assert [(g.bf16_tflops, g.hbm_tbps, g.nvlink_gbps, g.ib_gbps) for g in GPUS.values()] == [
        (989.0, 3.35, 450.0, 50.0),
        (989.0, 4.8, 450.0, 50.0),
        (2250.0, 8.0, 900.0, 50.0),
    ]
    assert hardware("h200", ["ib_gbps=25"]).ib_gbps == 25.0
    for name, sets, said in [
        ("a100", [], "--gpu 'a100': expected one of ['b200', 'h100', 'h200']"),
        ("h100", ["nvlink=1"], "--gpu-set 'nvlink=1': expected NAME=VALUE"),
        ("h100", ["ib_gbps=0"], "--gpu-set 'ib_gbps=0'"),
    ]:
        with pytest.raises(ValueError) as err:
            hardware(name, sets)
        assert said in str(err.value)
    with pytest.raises(ValueError, match="--efficiency 'matmul=2': expected NAME=VALUE"):
        Efficiency.parse(["matmul=2"], hardware("h100"))
    changed = Efficiency.parse(["ib=0.5"], hardware("b200"))
    assert changed == dataclasses.replace(Efficiency.of(hardware("b200")), ib=0.5)


def test_each_gpus_efficiencies_are_its_published_kernel_measurements():
    """By hand from the published figures (``plan/kernel_rates.py``): the GEMM's TFLOP/s over the
    peak; FlashAttention-3's forward and backward (a backward counted as 2.5 forwards by FA,
    as 2 by us); fla's gated delta rule over one 4,096-token row at the 35B's heads, whose FLOPs
    are ours, times 3 forward-equivalents over its forward-and-backward time."""
    h100, h200, b200 = (Efficiency.of(hardware(g)) for g in ("h100", "h200", "b200"))
    assert h100.matmul == h100.head == pytest.approx(794.5 / 989)
    assert b200.matmul == pytest.approx(1745 / 2250)
    assert h100.grouped == b200.grouped == pytest.approx(180.67 / 989)
    assert h100.attention == pytest.approx(3 / (1 / 612 + 2.5 / 542) / 989)
    assert b200.attention == pytest.approx(3 / (1 / 1613 + 2.5 / (1613 * 542 / 612)) / 2250)
    recipe = load_recipe("qwen3_5_35b_a3b", hub_weights=False)
    config = build_config(recipe.model)
    flops = forward_flops(config, [4096], [], layer_types=["linear_attention"], mtp=0, head=False)
    assert flops["gdn_core"] == kernel_rates.GDN_ROW_FLOPS
    rate = 3 * flops["gdn_core"] / (0.288e-3 * 5.964 / 1.581)
    assert h100.recurrence == pytest.approx(rate / 989e12)
    assert h100.hbm == pytest.approx(3.01 / 3.35) and b200.hbm == pytest.approx(6516.67 / 8000)
    assert h200 == h100  # the same chip: nothing of its own published


def test_plan_prints_the_step_time_on_the_chosen_gpu(tmp_path, capsys):
    """``--gpu h200``: its memory is the verdict's; ``--gpu-set`` slows the links that cross
    nodes; bad flags exit 2 with the reason."""
    sets = [a for item in PACKED for a in ("--set", item)]
    out = tmp_path / "plan.json"
    assert main(["plan", str(TINY), *sets, "--gpu", "h200", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "step time on H200 SXM" in table and "fits in 140 GiB" in table
    for line in ("tokens/s/GPU", "model TFLOP/s/GPU", "exposed communication", "ep_all_to_all"):
        assert line in table, line
    fast = json.loads(out.read_text())["step_time"]
    slow_args = ["--node-gpus", "2", "--gpu-set", "ib_gbps=0.001", "--json", str(out)]
    assert main(["plan", str(TINY), *sets, *slow_args]) == 0
    slow = json.loads(out.read_text())["step_time"]
    assert slow["seconds"] > fast["seconds"]
    assert slow["tokens_per_second_per_gpu"] < fast["tokens_per_second_per_gpu"]
    capsys.readouterr()
    assert main(["plan", str(TINY), *sets, "--gpu", "x"]) == 2
    assert "--gpu 'x': expected one of" in capsys.readouterr().err
    assert main(["plan", str(TINY), *sets, "--efficiency", "ib=0"]) == 2
    assert "--efficiency 'ib=0'" in capsys.readouterr().err


def test_a_datasets_memory_holds_its_densest_micro_batch_and_its_time_a_typical_one():
    """Of the packed rows read from a dataset (their patch grids), one micro-batch of 2 rows:
    the memory's is the two rows with the most patches, the step time's the two around the
    median (a run's steps average over its rows)."""
    from qwen35_trainer.plan.dataset_media import (
        DatasetMedia,
        densest_micro_batch,
        typical_micro_batch,
    )

    rows = (((1, 2, 2),), ((1, 8, 8),), (), ((1, 4, 4), (1, 2, 2)), ((2, 4, 4),))
    media = DatasetMedia("rows.jsonl", 5, rows)  # patches 4, 64, 0, 20, 32
    assert densest_micro_batch(media, 2) == ((2, 4, 4), (1, 8, 8))
    assert typical_micro_batch(media, 2) == ((1, 2, 2), (1, 4, 4), (1, 2, 2))
    assert densest_micro_batch(media, 9) == typical_micro_batch(media, 9)  # every row
