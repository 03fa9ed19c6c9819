"""Pipeline parallelism before any rank starts: the stage split (balanced against a brute-force
search, or the recipe's own), the stage placement, and one message for every layout PP cannot
run (launcher-side: no worker starts). The runs themselves are test_train_dp.py's ``pp*``
layouts, each against one process."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from helpers import tiny

from qwen35_trainer import cli, load_recipe, validate_layout
from qwen35_trainer.cli import main
from qwen35_trainer.model import build_config
from qwen35_trainer.model.flops import layer_costs
from qwen35_trainer.model.pipeline.build import stage_layers
from qwen35_trainer.parallel.pipeline_split import balanced_split, stages_of_rank
from qwen35_trainer.plan import plan
from qwen35_trainer.plan.stages import bubble_fraction, stage_view

PP2 = ("parallel.pp=2", "data.packing=true", "data.pack_length=256", "train.grad_accum_steps=2")


def _loads(costs, counts, first, last):
    bounds = list(itertools.accumulate([0, *counts]))
    loads = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
    loads[0] += first
    loads[-1] += last
    return loads


def _brute_force(costs, stages, first, last):
    """``(least most expensive stage, least sum of squares among those)`` over every way to cut
    ``costs`` in order."""
    best = (float("inf"), float("inf"))
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        counts = [b - a for a, b in itertools.pairwise((0, *cuts, len(costs)))]
        loads = _loads(costs, counts, first, last)
        best = min(best, (max(loads), sum(x * x for x in loads)))
    return best


def test_balanced_split_is_the_best_contiguous_split():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = [rng.choice([1.0, 3.0, rng.random() * 5]) for _ in range(n)]
        first, last = rng.random() * 6, rng.random() * 6
        counts = balanced_split(costs, stages, first, last)
        assert len(counts) == stages and sum(counts) == n and min(counts) >= 1
        loads = _loads(costs, counts, first, last)
        most, squares = _brute_force(costs, stages, first, last)
        assert max(loads) == pytest.approx(most)
        assert sum(x * x for x in loads) == pytest.approx(squares)


def test_an_expensive_first_stage_leaves_the_others_balanced():
    """The vision tower makes stage 0 the bottleneck; the other layers still split evenly."""
    counts = balanced_split([1.0] * 12, 4, first=10.0, last=0.0)
    assert counts[0] == 1 and sorted(counts[1:]) == [3, 4, 4]


def test_the_cost_model_tells_the_layer_kinds_apart():
    """Full attention grows with the row, Gated DeltaNet does not: at a long row the tiny model's
    full-attention layer costs more than its DeltaNet layers, whose costs are equal."""
    config = build_config(tiny().model)
    costs, tower, head = layer_costs(config, 65536)
    kinds = config.text_config.layer_types
    delta = {c for c, k in zip(costs, kinds, strict=True) if k == "linear_attention"}
    full = [c for c, k in zip(costs, kinds, strict=True) if k == "full_attention"]
    assert len(delta) == 1 and full[0] > next(iter(delta)) and tower > 0 and head > 0


def test_stage_layers_default_explicit_and_placement():
    recipe = tiny(*PP2, "parallel.dp=1", "parallel.cp=1", "parallel.ep=1")
    config = build_config(recipe.model)
    split = stage_layers(recipe, config)
    assert [len(r) for r in split] and sum(len(r) for r in split) == 4
    assert [r.start for r in split] == [0, split[0].stop]
    mine = tiny(
        *PP2, "parallel.dp=1", "parallel.cp=1", "parallel.ep=1", "parallel.pp_layers=[3, 1]"
    )
    assert stage_layers(mine, config) == [range(0, 3), range(3, 4)]
    assert stages_of_rank(1, pp=2, virtual=2) == [1, 3]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("parallel.pp_layers=[3, 3]",), "parallel.pp_layers=[3, 3] sums to 6, not the 4 layers"),
        (("parallel.pp_layers=[4]",), "parallel.pp_layers must list 2 layer counts"),
        (("parallel.pp=5", "train.grad_accum_steps=5"), "4 decoder layers, fewer than"),
        (("train.grad_accum_steps=1",), "1f1b needs at least parallel.pp=2 micro-batches"),
        (("parallel.pp_schedule=looped",), "parallel.pp_schedule must be one of"),
        (("parallel.pp_schedule=zbv",), "(V-shaped zero bubble) is not built yet"),
        (
            ("parallel.pp_schedule=interleaved_zb",),
            "parallel.pp_schedule=interleaved_zb interleaves stages: parallel.pp_virtual_stages "
            "must be >= 2",
        ),
        (("parallel.pp_virtual_stages=2",), "runs one stage per rank"),
        (("parallel.pp_schedule=interleaved_1f1b",), "pp_virtual_stages must be >= 2"),
        (("parallel.pp_microbatches=4",), "must equal train.grad_accum_steps=2"),
        (("data.packing=false",), "needs data.packing with data.pack_length"),
        (("parallel.tp=2", "parallel.sequence_parallel=false"), "runs with sequence parallelism"),
    ],
)
def test_layouts_pipelines_cannot_run_are_refused(sets, message):
    recipe = tiny(*PP2, "parallel.dp=1", "parallel.cp=1", "parallel.ep=1", *sets)
    config = build_config(recipe.model)
    with pytest.raises(ValueError, match="invalid parallel layout") as err:
        validate_layout(recipe, recipe.parallel.world, config=config, on_this_machine=False)
    assert message in str(err.value)


def test_pipeline_refusals_come_before_any_worker_starts(capsys, monkeypatch):
    """``pp`` not dividing the launch, and a schedule short of micro-batches: one message from
    the launching process."""

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(cli, "launch", no_workers)
    assert main(["tiny", "--set", "parallel.pp=3", "--set", "train.eval_every=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("qwen35-train:") == 1 and "needs at least parallel.pp=3" in err
    monkeypatch.setenv("WORLD_SIZE", "6")  # as if launched: 6 ranks for a layout of 2 x 4
    assert main(["tiny", "--set", "parallel.pp=2", "--set", "train.grad_accum_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "parallel.pp=2 x dp_replicate=1 x dp=2 x cp=2 x tp=1 = 8 ranks" in err


def test_the_readme_pipeline_example_is_a_valid_layout(tmp_path):
    """The README's ``parallel.pp`` block on the 397B recipe: a layout the launcher accepts."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Pipeline parallelism", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    base = Path(__file__).parents[2] / "recipes" / "qwen3_5_397b_a17b.yaml"
    (tmp_path / "pp.yaml").write_text(f"base: {base}\n{block}")
    recipe = load_recipe(tmp_path / "pp.yaml")
    config = build_config(recipe.model)
    dims = validate_layout(recipe, recipe.parallel.world, config=config, on_this_machine=False)
    assert (dims.pp, dims.world) == (4, 32)
    split = stage_layers(recipe, config)
    assert len(split) == 4 and sum(map(len, split)) == config.text_config.num_hidden_layers


def test_the_plan_of_a_pipeline_counts_each_stage():
    """``qwen35-train plan`` under PP plans the first rank of every stage: their parameters
    add up to the one-stage plan's (the stages partition the model), the first stage holds the
    activations of more micro-batches than the last (1F1B), and the bubble and the P2P traffic
    are reported."""
    one = ("parallel.dp=1", "parallel.cp=1", "parallel.ep=1", *PP2[1:], "train.eval_every=0")
    staged = plan(tiny(*one, "parallel.pp=2", "train.grad_accum_steps=4"))
    whole = plan(tiny(*one, "parallel.pp=1", "train.grad_accum_steps=4"))
    assert sorted(staged.ranks) == [0, 1] and list(whole.ranks) == [0]
    assert sum(m.parameters for m in staged.ranks.values()) == whole.ranks[0].parameters
    assert staged.total_parameters == whole.total_parameters
    assert staged.bubble == pytest.approx(1 / 5) and whole.bubble is None
    assert staged.communication["pp_p2p"] > 0


def test_micro_batches_in_flight_per_schedule():
    """GPipe holds every micro-batch, 1F1B ``pp - rank``, interleaved its warm-up's stage
    chunks over the stages per rank, interleaved zero bubble one chunk more (the one whose
    weights' pass is deferred). A rank runs every forward before its first backward
    (``forwards_first``: its backward then trades activations for gradients) under GPipe, and
    under 1F1B where its warm-up covers all the micro-batches, never with a split backward."""
    from types import SimpleNamespace

    def view(schedule, mine, count, microbatches=8):
        plan_ = SimpleNamespace(stage_layers=[range(i, i + 1) for i in range(count)], mine=mine)
        plan_.schedule = schedule
        layers = ["full_attention"] * count
        return stage_view(SimpleNamespace(plan=plan_), layers, microbatches, 4)

    assert view("gpipe", [0], 4).in_flight == 8 and view("gpipe", [3], 4).forwards_first
    assert [view("1f1b", [r], 4).in_flight for r in range(4)] == [4, 3, 2, 1]
    assert not any(view("1f1b", [r], 4).forwards_first for r in range(4))
    assert [view("1f1b", [r], 4, 2).forwards_first for r in range(4)] == [True, True, True, False]
    interleaved = view("interleaved_1f1b", [0, 4], 8)
    assert interleaved.in_flight == (4 + 6 + 1) / 2 and interleaved.sends == 2
    assert (interleaved.first, interleaved.last, interleaved.receives) == (True, False, 1)
    assert bubble_fraction("1f1b", 4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1f1b", 4, 2, 8) == pytest.approx(3 / 19)
    # zero bubble: the weights' passes fill two thirds of it (equal F, B and W)
    assert bubble_fraction("interleaved_zb", 4, 2, 8) == pytest.approx(3 / 51)
    zb = view("interleaved_zb", [0, 4], 8)
    assert zb.in_flight == (4 + 6 + 1 + 1) / 2
    assert not view("interleaved_zb", [0, 4], 8, 2).forwards_first
