"""``qwen35-train plan --search``: the candidate layouts keep the recipe's step, the groups
spanning nodes come from the trainer's own rank grids (checked against rank arithmetic), the
ranking (fitting first, then the predicted step time), the command it prints; and the per-rank
verdict of a plan whose stages differ."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from helpers import SYNTHETIC, TINY

from qwen35_trainer import load_recipe
from qwen35_trainer.cli import main
from qwen35_trainer.parallel import ParallelDims
from qwen35_trainer.plan import Headroom
from qwen35_trainer.plan.memory import Memory
from qwen35_trainer.plan.nodes import crossing_groups
from qwen35_trainer.plan.planner import GIB, Plan
from qwen35_trainer.plan.search import candidates, search

# the tiny recipe's layout (DP 2 x CP 2 with EP 2) on packed rows: 8 samples per step, 2 per
# micro-batch and group
PACKED = (
    *SYNTHETIC,
    "data.packing=true",
    "data.pack_length=256",
    "data.samples_per_rank=4",
    "train.grad_accum_steps=2",
)


def _dims(pp=1, r=1, d=1, c=1, t=1, e=1) -> ParallelDims:
    p = load_recipe(TINY).parallel
    parallel = dataclasses.replace(p, pp=pp, dp_replicate=r, dp=d, cp=c, tp=t, ep=e)
    return ParallelDims.from_recipe(parallel, pp * r * d * c * t)


def _rank(dims, p, r, d, c, t) -> int:
    """The rank of mesh coordinates (pp, dp_replicate, dp_shard, cp, tp), outermost first."""
    return (((p * dims.dp_replicate + r) * dims.dp + d) * dims.cp + c) * dims.tp + t


def _spans(dims, node, members) -> bool:
    """Whether any group (an iterable of rank lists) has ranks on two nodes."""
    return any(len({m // node for m in group}) > 1 for group in members)


@pytest.mark.parametrize(
    "shape",
    [
        dict(pp=30, d=8, e=8),  # the PP recipe: only the pipeline crosses nodes
        dict(d=8, c=32, e=32),  # the 397B recipe: everything does
        dict(pp=2, r=2, d=2, c=2, e=2),  # HSDP: the shard group inside the node
        dict(pp=2, d=2, c=2, t=2, e=4),  # EP over dp x cp
    ],
    ids=["pp30_dp8_ep8", "dp8_cp32_ep32", "pp2_hsdp2_dp2_cp2", "pp2_dp2_cp2_tp2_ep4"],
)
def test_groups_spanning_nodes_match_rank_arithmetic(shape):
    """The dense kinds (FSDP over dp x cp, CP, PP) against groups listed from the rank formula;
    EP and the experts' FSDP group against their definition (ranks of one stage, replica and
    TP coordinate: EP groups of ``ep`` ranks partitioning the dp x cp ranks in the expert
    grid's order, the experts' FSDP groups the rest)."""
    dims, node = _dims(**shape), 8
    P, R, D, C, T = dims.pp, dims.dp_replicate, dims.dp, dims.cp, dims.tp
    coords = list(itertools.product(range(P), range(R), range(D), range(C), range(T)))
    shard = [
        [_rank(dims, p, r, d, c, t) for d in range(D) for c in range(C)]
        for p, r, t in itertools.product(range(P), range(R), range(T))
    ]
    cp = [[_rank(dims, p, r, d, c, t) for c in range(C)] for p, r, d, c0, t in coords if c0 == 0]
    pp = [[_rank(dims, p, r, d, c, t) for p in range(P)] for p0, r, d, c, t in coords if p0 == 0]
    expected = {
        "fsdp_all_gather": _spans(dims, node, shard),
        "cp_exchange": _spans(dims, node, cp),
        "pp_p2p": _spans(dims, node, pp),
    }
    crossing = crossing_groups(dims, node)
    for kind, spans in expected.items():
        assert (kind in crossing) == spans, (kind, crossing)
    assert ("fsdp_reduce_scatter" in crossing) == expected["fsdp_all_gather"]
    assert ("vision_gather" in crossing) == expected["cp_exchange"]
    # EP borrows dp x cp ranks: a group inside the node whenever the shard group is
    if not expected["fsdp_all_gather"]:
        assert not {"ep_all_to_all", "expert_fsdp_all_gather"} & crossing


def test_the_layouts_of_the_pp_recipe_and_of_the_256_gpu_recipe():
    assert crossing_groups(_dims(pp=30, d=8, e=8), 8) == {"pp_p2p"}
    assert crossing_groups(_dims(d=8, c=32, e=32), 8) == {
        "fsdp_all_gather",
        "fsdp_reduce_scatter",
        "expert_fsdp_all_gather",
        "expert_fsdp_reduce_scatter",
        "ep_all_to_all",
        "cp_exchange",
        "vision_gather",
    }


def test_candidates_keep_the_recipes_step_and_micro_batch():
    """Every layout at world 4 (nodes of 2 GPUs: HSDP variants too), each with the recipe's 8
    samples per step and 2 per micro-batch and group."""
    recipe = load_recipe(TINY, PACKED)
    keys = ("pp", "dp_replicate", "dp", "cp", "ep")
    listed = list(candidates(recipe, 4, node_gpus=2, pp_values=None))
    assert {layout["tp"] for layout, _ in listed} == {recipe.parallel.tp}  # the recipe's TP kept
    found = {tuple(layout[k] for k in keys): sets for layout, sets in listed}
    assert set(found) == {
        (1, 1, 4, 1, 2),
        (1, 2, 2, 1, 2),
        (1, 1, 2, 2, 2),
        (1, 2, 1, 2, 2),
        (2, 1, 2, 1, 2),
        (2, 1, 1, 2, 2),
        (4, 1, 1, 1, 1),
    }
    for (pp, r, dp, cp, ep), sets in found.items():
        r_ = load_recipe(TINY, [*PACKED, *sets])
        p = r_.parallel
        assert (p.pp, p.dp_replicate, p.dp, p.cp, p.ep, p.world) == (pp, r, dp, cp, ep, 4)
        assert p.dp_replicate * p.dp * r_.data.samples_per_rank == 8
        assert r_.data.samples_per_rank // r_.train.grad_accum_steps == 2
    # a step that does not divide is said, not dropped
    odd = load_recipe(TINY, [*PACKED, "data.samples_per_rank=3", "train.grad_accum_steps=1"])
    reasons = [s for _, s in candidates(odd, 4, node_gpus=8) if isinstance(s, str)]
    assert "the step's 6 samples do not split over 4 groups by 3" in reasons


@pytest.fixture(scope="module")
def searched():
    recipe = load_recipe(TINY, PACKED)
    return search(recipe, lambda sets: load_recipe(TINY, [*PACKED, *sets]), world=4, node_gpus=2)


def test_search_ranks_fits_then_step_time(searched):
    """Best first: every fitting plan before the rest, then the shortest predicted step (each
    candidate's own plan timed on the H100 with nodes of 2 GPUs); the bytes over groups that
    span nodes (each the planned ranks' most: the sum of its crossing kinds) stay a column."""
    from qwen35_trainer.plan.hardware import hardware
    from qwen35_trainer.plan.timing import step_time

    keys = [c.rank_key() for c in searched]
    assert keys == sorted(keys) and len(searched) == 7
    planned = [c for c in searched if c.plan is not None]
    assert len(planned) == 7 and all(c.fits for c in planned)
    for c in planned:
        p = c.recipe.parallel
        crossing = crossing_groups(ParallelDims.from_recipe(p, 4), 2)
        most = max(
            sum(n for k, n in t.items() if k in crossing) for t in c.plan.rank_traffic.values()
        )
        assert c.inter_node == most
        assert c.time.seconds == step_time(c.plan, hardware("h100"), node_gpus=2).seconds
    # nodes of 2 GPUs: FSDP over the 4 ranks, HSDP's all-reduce and the pipeline's sends
    # cross them
    assert all(c.inter_node > 0 for c in planned)
    times = [c.time.seconds for c in planned]
    assert times == sorted(times) and times[0] < times[-1]


def test_the_ranking_puts_the_step_time_before_the_bytes_over_nodes():
    """Two fitting layouts: the one sending more over the nodes but predicted faster ranks
    first; an unplanned one ranks last; among equal times the fewer bytes win."""
    from qwen35_trainer.plan.search import Candidate

    def fake(seconds, inter_node):
        time = dataclasses.replace(_step(), seconds=seconds)
        return Candidate({}, (), None, _fitting_plan(), inter_node=inter_node, time=time)

    fast_wide, slow_narrow = fake(1.0, 10 * GIB), fake(2.0, 0)
    refused = Candidate({}, (), None, reason="no")
    ranked = sorted([refused, slow_narrow, fast_wide], key=Candidate.rank_key)
    assert ranked == [fast_wide, slow_narrow, refused]
    tie = fake(1.0, GIB)
    assert sorted([fast_wide, tie], key=Candidate.rank_key) == [tie, fast_wide]


def _fitting_plan() -> Plan:
    layout = dict(pp=1, dp_replicate=1, dp=1, cp=1, tp=1, ep=1)
    return Plan("x", 1, layout, 0, 0, {0: Memory(GIB, 0, 0, 0, 0, 0, 0, 0, 0)}, {}, 80.0)


def _step():
    from qwen35_trainer.plan.hardware import hardware
    from qwen35_trainer.plan.timing import StepTime

    return StepTime(hardware("h100"), 1.0, 1.0, {}, 0.0, 0.0, 1, 1.0, 1)


def test_the_printed_command_plans_the_best_layout(searched, capsys):
    best = searched[0]
    args = [a for item in [*PACKED, *best.sets] for a in ("--set", item)]
    assert main(["plan", str(TINY), *args]) == 0
    assert f"predicted peak {best.plan.peak_gib:.2f} GiB" in capsys.readouterr().out


def test_search_command(capsys):
    sets = [a for item in PACKED for a in ("--set", item)]
    assert main(["plan", str(TINY), *sets, "--search", "--pp", "2", "--node-gpus", "2"]) == 0
    said = capsys.readouterr()
    out = said.out
    assert "search: " in out and "best: PP 2" in out
    assert "qwen35-train plan " in out.splitlines()[-1] and "parallel.pp=2" in out
    rows = [line for line in out.splitlines() if line.startswith("  PP 2")]
    assert rows and len(rows) == len(set(rows))  # each candidate once, in the ranked table
    assert said.err.count("searched:") == len(rows)  # the progress goes to stderr
    command = out.splitlines()[-1]
    assert "pp_microbatches" not in command and "dp_replicate=1" not in command  # no no-op sets
    assert main(["plan", str(TINY), *sets, "--search", "--node-gpus", "0"]) == 2
    assert "--node-gpus must be >= 1, got 0" in capsys.readouterr().err
    # no layout fits: exit 3
    assert main(["plan", str(TINY), *sets, "--search", "--pp", "4", "--gpu-memory", "1"]) == 3
    # a micro-batch of 4 samples: 2 micro-batches at PP 4, fewer than 1F1B needs; said
    fewer = [*sets, "--set", "train.grad_accum_steps=1"]
    assert main(["plan", str(TINY), *fewer, "--search", "--pp", "4"]) == 3
    out = capsys.readouterr().out
    assert "PP 4" in out and "needs at least parallel.pp=4 micro-batches" in out
    assert "no layout of this step fits in 80 GiB" in out


def test_the_verdict_is_the_worst_ranks_own_peak():
    """Under PP the largest counted rank and the largest transient rank differ: the predicted
    peak is each rank's counted bytes plus its own headroom, the largest of them (not the
    largest counted plus the largest transient)."""
    # rank 0: small state, large transient; rank 1: large state, small transient
    heavy_transient = Memory(1 * GIB, 1 * GIB, 2 * GIB, 30 * GIB, 0, 0, 0, 0, 0)
    heavy_state = Memory(10 * GIB, 10 * GIB, 20 * GIB, 5 * GIB, 0, 0, 0, 0, 0)
    quiet = Headroom(0, 0, 0, 1.0)
    layout = dict(pp=2, dp_replicate=1, dp=1, cp=1, tp=1, ep=1)
    p = Plan("x", 2, layout, 0, 0, {0: heavy_transient, 1: heavy_state}, {}, 80.0, quiet)
    # rank 0: 34 + 31 transient = 65; rank 1: 45 + 15 = 60 (not 45 + 31 = 76)
    assert p.worst_rank == 0 and p.peak_gib == pytest.approx(65.0)
    assert p.counted_gib == pytest.approx(34.0) and p.transient_gib == pytest.approx(31.0)
    assert p.rank_peak(1) / GIB == pytest.approx(60.0)


def test_the_readme_search_picks_the_pp_recipes_own_layout(tmp_path, capsys):
    """The README's search on the 397B PP recipe: its best layout is the recipe's own (PP 30 x
    DP 8 with EP 8), the only one that fits (77.15 GiB predicted on the last stage; README and
    recipe), sending nothing but the pipeline's P2P over the nodes; PP 15 x DP 16 would also
    send its FSDP traffic over two nodes."""
    import shlex
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    line = next(
        x for x in readme.splitlines() if x.startswith("qwen35-train plan ") and "--search" in x
    )
    out = tmp_path / "search.json"
    assert main([*shlex.split(line)[1:], "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    best, others = rows[0], rows[1:]
    recipe = load_recipe("qwen3_5_397b_a17b_pp")
    assert load_recipe("qwen3_5_397b_a17b_pp", best["sets"]) == recipe
    assert best["plan"]["fits"]
    assert best["plan"]["predicted_peak_gib"] == pytest.approx(77.15, abs=0.01)
    p2p = max(t["pp_p2p"] for t in best["plan"]["rank_traffic"].values())
    assert best["inter_node_bytes"] == p2p
    assert crossing_groups(ParallelDims.from_recipe(recipe.parallel, 240), 8) == {"pp_p2p"}
    assert len(others) == 2 and not any(r["plan"]["fits"] for r in others)
    wide = next(r for r in others if "parallel.dp=16" in r["sets"])
    assert wide["inter_node_bytes"] > best["inter_node_bytes"]
    assert "best: PP 30 × DP 8 × EP 8" in capsys.readouterr().out
