"""ParallelDims: every refusal pinned to its message, and the expert mesh's rank grid.

The grid is checked as data (which ranks form each EP / expert-FSDP group) for the layouts the
trainer supports, and one fake 128-rank world (torch's ``fake`` backend, one process) builds the
published 122B-A10B layout — DP 4 × CP 32 with EP 8 inside the CP groups — through the real
mesh code.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from qwen35_trainer import ParallelRecipe, validate_layout
from qwen35_trainer.parallel import ParallelDims
from qwen35_trainer.parallel.apply import check_tp_heads


def check_layout(spec: ParallelRecipe, world: int, *, packing: bool):
    """:func:`validate_layout` of a recipe with this ``parallel`` section and packing (no
    multi-token-prediction head, rows as long as their documents)."""
    recipe = SimpleNamespace(
        parallel=spec,
        data=SimpleNamespace(packing=packing, pack_length=None),
        model=SimpleNamespace(mtp_depth=0, lora=None),
    )
    return validate_layout(recipe, world)


@pytest.mark.parametrize(
    ("spec", "world", "packing", "message"),
    [
        (
            dict(dp=2, cp=2),
            2,
            True,
            r"dp_replicate=1 x dp=2 x cp=2 x tp=1 = 4 ranks, but the launched world size "
            r"\(WORLD_SIZE\) is 2: launch with `torchrun --nproc-per-node 4",
        ),
        (dict(dp=4, ep=3), 4, False, r"parallel.ep=3 must divide parallel.dp x parallel.cp = 4"),
        (dict(dp=2, cp=2, ep=8), 4, True, r"parallel.ep=8 must divide parallel.dp x parallel.cp"),
        (dict(dp=1, cp=2), 2, False, r"parallel.cp > 1 needs data.packing"),
        (dict(dp=2, tp=0), 2, False, r"parallel.tp must be an integer >= 1, got 0"),
        (dict(dp=2, ep_first="tp"), 2, False, r"parallel.ep_first must be one of \('cp', 'dp'\)"),
        (dict(dp=2, dp_replicate=2), 2, False, r"dp_replicate=2 x dp=2 .* = 4 ranks"),
        (dict(dp=1, tp=2), 2, False, r"parallel.tp > 1 needs data.packing: the TP-split Gated"),
    ],
)
def test_every_refusal_says_why(spec, world, packing, message):
    with pytest.raises(ValueError, match=message):
        check_layout(ParallelRecipe(**spec), world, packing=packing)


def test_several_reasons_are_reported_together():
    with pytest.raises(ValueError, match=r"= 4 ranks.*; parallel.ep=3 must divide.*; parallel.cp"):
        check_layout(ParallelRecipe(dp=2, cp=2, ep=3), 2, packing=False)


def test_layouts_of_the_issue_fit():
    for spec in (
        dict(cp=4, ep=2),
        dict(dp=2, cp=2, ep=4),
        dict(dp=2, cp=2, ep=2, ep_first="dp"),
        dict(tp=2, cp=2),
        dict(dp=2, tp=2, ep=2),
        dict(dp=2, tp=2),
        dict(dp=2, dp_replicate=2),
    ):
        check_layout(ParallelRecipe(**spec), 4, packing=True)
    dims = check_layout(ParallelRecipe(dp=4, cp=32, ep=8), 128, packing=True)
    assert (dims.batch, dims.efsdp, dims.ep_factors) == (128, 16, (1, 8))


def test_tp_must_split_heads_whole():
    from helpers import tiny

    from qwen35_trainer import build_config

    text = build_config(tiny().model).text_config
    check_tp_heads(text, 2)
    with pytest.raises(
        ValueError,
        match=r"parallel.tp=4 must divide the attention head counts .*"
        r"'num_key_value_heads': 2",
    ):
        check_tp_heads(text, 4)


def _groups(grid: torch.Tensor, dim: int) -> set[tuple[int, ...]]:
    moved = grid.movedim(dim, -1)
    return {tuple(row.tolist()) for row in moved.reshape(-1, moved.shape[-1])}


def _dense(dims: ParallelDims) -> torch.Tensor:
    shape = (dims.dp_replicate, dims.dp, dims.cp, dims.tp)
    return torch.arange(dims.world).reshape(shape)


@pytest.mark.parametrize(
    ("spec", "ep_groups"),
    [
        # CP 4, EP 2: EP groups inside the CP group (the 122B shape in miniature)
        (dict(launched=4, cp=4, ep=2), {(0, 1), (2, 3)}),
        # DP 2 x CP 2, EP 4: one EP group spanning both DP ranks and both CP ranks
        (dict(launched=4, dp=2, cp=2, ep=4), {(0, 1, 2, 3)}),
        # DP 2 x CP 2, EP 2 = the CP groups
        (dict(launched=4, dp=2, cp=2, ep=2), {(0, 1), (2, 3)}),
        # DP 2 x CP 2, EP 2 over DP: ranks with the same CP index
        (dict(launched=4, dp=2, cp=2, ep=2, ep_first="dp"), {(0, 2), (1, 3)}),
        # DP 2 x TP 2, EP 2: over DP, never across TP peers (0, 1 and 2, 3)
        (dict(launched=4, dp=2, tp=2, ep=2), {(0, 2), (1, 3)}),
        # HSDP 2 x DP 2, EP 2: inside each replica
        (dict(launched=4, dp_replicate=2, dp=2, ep=2), {(0, 1), (2, 3)}),
    ],
)
def test_expert_groups(spec, ep_groups):
    dims = ParallelDims(**spec)
    grid = dims.expert_grid(_dense(dims))
    assert _groups(grid, 2) == ep_groups
    assert sorted(grid.flatten().tolist()) == list(range(dims.world))
    # an EP group holds different tokens: same dp_replicate and tp coordinates, so no TP peers
    dense = _dense(dims)
    coord = {int(dense[i]): i for i in itertools.product(*map(range, dense.shape))}
    for group in _groups(grid, 2):
        assert len({(coord[r][0], coord[r][3]) for r in group}) == 1


def test_the_122b_layout_on_a_fake_128_rank_world():
    """The published run's layout built by the real mesh code in one process (fake backend)."""
    code = textwrap.dedent(
        """
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from qwen35_trainer.parallel import ParallelDims
        dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=128)
        dims = ParallelDims(launched=128, dp=4, cp=32, ep=8)
        meshes = dims.build("cpu")
        ranks = lambda m: dist.get_process_group_ranks(m.get_group())
        print(ranks(meshes.ep), ranks(meshes.cp)[:10], len(ranks(meshes.batch)),
              ranks(meshes.expert_fsdp), meshes.data_group())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("] ")[0] == "[0, 1, 2, 3, 4, 5, 6, 7"  # EP 8 inside CP group 0..31
    assert "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9] 128" in out.stdout
    # expert FSDP: the ranks at EP index 5 of the 16 EP groups; rank 5 takes data group 0
    efsdp = [5 + 8 * i for i in range(16)]
    assert out.stdout.strip().endswith(f"{efsdp} 0"), out.stdout


def test_a_second_run_computes_on_its_own_meshes():
    """DTensor caches ops' output specs by their inputs' specs, and a mesh equals any mesh over
    the same ranks and names: an op on the second run's DTensors returned the FIRST run's mesh,
    whose process group then served that run's collectives on some ranks and not on others (a
    megatron-fsdp HSDP run after another hung in the gradient-norm all-reduce). Each build
    starts from an empty cache (fake backend, one process, the HSDP shard group of rank 0)."""
    code = textwrap.dedent(
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Shard
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from qwen35_trainer.parallel import ParallelDims
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        for run in range(2):
            mesh = ParallelDims(launched=4, dp_replicate=2, dp=2).build("cpu").shard
            doubled = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)]) * 2
            print(mesh.get_group().group_name, doubled.device_mesh.get_group().group_name)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    runs = [line.split() for line in out.stdout.splitlines()]
    assert len(runs) == 2 and runs[0][0] != runs[1][0], out.stdout  # each run its own groups
    for own, computed_on in runs:
        assert computed_on == own, out.stdout


def test_each_dimension_is_named_once_and_the_layout_reads_the_table():
    """The dimensions table (recipe/dimensions.py) gives each dimension's mesh axis, and the
    layout's world, rank grid, worker-count product and degrees come from it; the layout holds
    the recipe's section (it is not one) and reads its settings through."""
    from qwen35_trainer.parallel import MeshAxis
    from qwen35_trainer.recipe.dimensions import DIMENSIONS, degrees, product

    assert {MeshAxis(d.axis) for d in DIMENSIONS} <= set(MeshAxis)
    spec = ParallelRecipe(pp=2, dp_replicate=1, dp=3, cp=2, tp=2, ep=2, pp_schedule="gpipe")
    dims = ParallelDims(spec, launched=24)
    assert not isinstance(dims, ParallelRecipe)
    assert (dims.world, spec.world, dims.dense_shape) == (24, 24, (2, 1, 3, 2, 2))
    assert (dims.pp_schedule, dims.ep, dims.parallel) == ("gpipe", 2, spec)
    assert degrees(spec) == dict(pp=2, dp_replicate=1, dp=3, cp=2, tp=2, ep=2)
    assert product(spec, ones=False) == "pp 2 x dp 3 x cp 2 x tp 2"
    assert ParallelDims(launched=4, dp=4) == ParallelDims(ParallelRecipe(dp=4), launched=4)


@pytest.mark.parametrize(
    ("spec", "multiple"),
    [
        (dict(dp=2), 8),
        (dict(cp=4, dp=1), 8),  # CP alone: each rank's share comes from the balanced layout
        (dict(cp=2, tp=2, dp=1), 8),  # SP: cp x tp = 4 divides 8
        (dict(cp=3, tp=2, dp=1), 24),  # SP: lcm(8, 6)
        (dict(tp=2, sequence_parallel=False, dp=1), 8),  # no SP: the TP ranks hold whole rows
        (dict(pp=2, cp=3, dp=1), 24),  # PP: every stage's CP ranks send equal token counts
    ],
)
def test_the_row_multiple_is_the_layouts(spec, multiple):
    """``ParallelDims.row_multiple``, the one statement of what a packed row's length divides
    by, and the one refusal that reads it."""
    p = ParallelRecipe(**spec)
    dims = ParallelDims(p, launched=p.world)
    assert dims.row_multiple == multiple
    recipe = SimpleNamespace(
        parallel=p,
        data=SimpleNamespace(packing=True, pack_length=multiple + 8),
        model=SimpleNamespace(mtp_depth=0, lora=None),
        train=SimpleNamespace(grad_accum_steps=2, compile=False),
    )
    if multiple == 8:
        return
    with pytest.raises(ValueError, match=rf"data.pack_length={multiple + 8} must be a multiple "):
        validate_layout(recipe, p.world)
