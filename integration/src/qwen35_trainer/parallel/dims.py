"""``ParallelDims``: every parallel degree of a run, validated once, and every device mesh.

Degrees, named as in the recipe's ``parallel`` section: ``dp_replicate`` (HSDP replicas),
``dp`` (FSDP-sharded data-parallel ranks; its mesh dim is ``dp_shard``), ``cp``
(context-parallel ranks sharing one packed row), ``tp`` (tensor-parallel ranks holding the same
tokens), ``ep`` (expert-parallel ranks) and ``pp`` (pipeline stages). The world is
``pp * dp_replicate * dp * cp * tp``; EP
adds no ranks: it BORROWS them from the ``dp * cp`` ranks that hold different tokens (the rule
of torchtitan's ParallelDims), so ``ep`` must divide ``dp * cp`` and the remaining factor
``efsdp = dp * cp / ep`` is the experts' FSDP dimension. ``data_groups = dp_replicate * dp``:
the data-parallel groups, each taking its own rows.

The meshes (built once by :meth:`ParallelDims.build`; nothing else in the trainer builds one):

- ``dense``: ``(dp_replicate, dp_shard, cp, tp)`` over the launched ranks, with the flattened
  views ``batch`` (dp_replicate × dp_shard × cp: the ranks holding different tokens, the loss
  group) and ``dp_shard_cp`` (the FSDP shard group of the dense parameters, replicated over
  ``dp_replicate`` for HSDP);
- ``pp`` (``pp > 1``): the pipeline stages, OUTERMOST: every mesh above is built over one
  stage's ranks (the slice of a ``(pp, ...)`` mesh at this rank's stage), so each stage is the
  ``pp = 1`` layout of its own ranks and every existing layout is unchanged;
- ``expert`` (``ep > 1``): ``(dp_replicate, efsdp, ep, tp)`` over the SAME ranks. Its rank grid
  is the dense grid with ``dp_shard`` split as ``(dp / e_dp, e_dp)`` and ``cp`` as
  ``(cp / e_cp, e_cp)`` where ``ep = e_dp * e_cp``, the EP factors moved inside:
  ``ep_first="cp"`` takes ``e_cp = gcd(ep, cp)`` (EP 8 inside CP 32, as the published 122B run;
  EP equal to a CP group; EP spanning CP groups when ``ep > cp``), ``ep_first="dp"`` takes
  ``e_dp = gcd(ep, dp)`` first. ``gcd`` always leaves a cofactor dividing the other dim
  when ``ep`` divides ``dp * cp`` (``ep / g`` and ``cp / g`` are coprime), so the check
  below is exactly the condition.

Correctness argument: the expert grid is derived from the dense mesh's own rank tensor (no rank
order is assumed), each rank appears once in each grid, and the EP group of a rank contains only
ranks with its ``dp_replicate`` and ``tp`` coordinates: EP exchanges tokens only between ranks
holding DIFFERENT tokens of the same model replica, and each token reaches its experts once.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_compat import flatten_mesh
from qwen35_trainer.recipe import ParallelRecipe
from qwen35_trainer.recipe.dimensions import RANK_DIMENSIONS, degree_problems, product, world_size

__all__ = ["EP_FIRST", "FSDP_BACKENDS", "ROW_UNIT", "MeshAxis", "Meshes", "ParallelDims"]

EP_FIRST = ("cp", "dp")
ROW_UNIT = 8  # every packed row's length divides by it (ParallelDims.row_multiple)
FSDP_BACKENDS = ("fsdp2", "megatron")


class MeshAxis(enum.StrEnum):
    """The names of the mesh dims (a member equals its string, so meshes index by either)."""

    DP_REPLICATE = "dp_replicate"  # HSDP replicas (recipe parallel.dp_replicate)
    DP_SHARD = "dp_shard"  # FSDP-sharded data-parallel ranks (recipe parallel.dp)
    CP = "cp"
    TP = "tp"
    EFSDP = "efsdp"  # the experts' FSDP dim: dp * cp / ep
    EP = "ep"
    BATCH = "batch"  # flattened dp_replicate x dp_shard x cp: the loss group
    PP = "pp"  # pipeline stages, the outermost dim (last here: the first four are ``dense``'s)


@dataclasses.dataclass
class Meshes:
    """Every mesh of a run. ``dense`` dims: dp_replicate, dp_shard, cp, tp; ``expert`` dims:
    dp_replicate, efsdp, ep, tp (``None`` without EP); ``batch``: the loss group's 1-D mesh;
    ``pp``: the pipeline's 1-D mesh through this rank (``None`` without PP)."""

    dims: ParallelDims
    dense: DeviceMesh
    batch: DeviceMesh
    shard: DeviceMesh
    expert: DeviceMesh | None
    pp: DeviceMesh | None = None

    @property
    def cp(self) -> DeviceMesh:
        return self.dense[MeshAxis.CP]

    @property
    def tp(self) -> DeviceMesh:
        return self.dense[MeshAxis.TP]

    @property
    def routing(self) -> DeviceMesh:
        """Every rank as one dim: under sequence parallelism the ranks routing different tokens
        (the loss group's ranks times their TP peers, each holding a slice)."""
        return flatten_mesh(self.dense, tuple(MeshAxis)[:4], "routing")

    @property
    def ep(self) -> DeviceMesh:
        return self.expert[MeshAxis.EP]

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """The experts' FSDP mesh: efsdp, or (dp_replicate, efsdp) for HSDP."""
        if self.dims.dp_replicate > 1:
            return self.expert[MeshAxis.DP_REPLICATE, MeshAxis.EFSDP]
        return self.expert[MeshAxis.EFSDP]

    def data_group(self) -> int:
        """Which data-parallel group's rows this rank takes (0 .. dp_replicate·dp - 1)."""
        r, d, _, _ = self.dense.get_coordinate()
        return r * self.dims.dp + d


class ParallelDims:
    """The run's layout: the recipe's ``parallel`` section (``parallel``; or its fields as
    keywords) on the ``launched`` ranks, validated once — invalid combinations raise
    ``ValueError`` with every reason. The dimensions are those of
    :data:`~qwen35_trainer.recipe.dimensions.DIMENSIONS`; the section's other settings
    (``pp_schedule``, ``ep_first``, ...) read through as attributes."""

    def __init__(
        self, parallel: ParallelRecipe | None = None, *, launched: int = 1, **settings: Any
    ) -> None:
        if parallel is None:
            parallel = ParallelRecipe(**settings)
        elif settings:
            raise TypeError(
                f"ParallelDims: give the parallel section or its fields, not both ({settings})"
            )
        self.parallel, self.launched = parallel, launched
        reasons = self.refusals()
        if reasons:
            raise ValueError("invalid parallel layout: " + "; ".join(reasons))

    def __getattr__(self, name: str) -> Any:
        if name in _SETTINGS:
            return getattr(self.__dict__["parallel"], name)
        raise AttributeError(f"ParallelDims has no attribute {name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParallelDims) and (self.parallel, self.launched) == (
            other.parallel,
            other.launched,
        )

    def __hash__(self) -> int:
        return hash((self.parallel, self.launched))

    def __repr__(self) -> str:
        return f"ParallelDims({self.parallel!r}, launched={self.launched})"

    @property
    def world(self) -> int:
        """The ranks the layout needs (:func:`~qwen35_trainer.recipe.dimensions.world_size`)."""
        return world_size(self.parallel)

    @property
    def sp(self) -> bool:
        return self.parallel.sp

    @property
    def dense_shape(self) -> tuple[int, ...]:
        """The degrees of the dimensions that add ranks, outermost first: the rank grid
        ``(pp, dp_replicate, dp_shard, cp, tp)``."""
        return tuple(getattr(self.parallel, d.key) for d in RANK_DIMENSIONS)

    @property
    def row_multiple(self) -> int:
        """What a packed row's length must divide by (the one statement of the rule): 8, the
        packed row's unit; and ``cp · tp`` where the CP and TP ranks must hold equal slices of
        the row — under sequence parallelism (the balanced CP layout gives each CP rank
        ``length / cp`` tokens, split over the TP ranks in equal slices) and under pipeline
        parallelism (every stage's CP and TP ranks send the same number of tokens)."""
        split = self.cp * self.tp if self.sp or self.pp > 1 else 1
        return math.lcm(ROW_UNIT, split)

    def refusals(self) -> list[str]:
        """Why this layout cannot run (empty when it can)."""
        bad = degree_problems(self.parallel)
        if bad:
            return bad
        reasons = []
        ranks = self.world
        if ranks != self.launched:
            reasons.append(
                f"parallel.{product(self.parallel, form='{key}={value}')} = {ranks} ranks, but "
                f"the launched world size (WORLD_SIZE) is {self.launched}: launch with "
                f"`torchrun --nproc-per-node {ranks} ...` or change the degrees (EP borrows "
                "ranks, it adds none)"
            )
        if (self.dp * self.cp) % self.ep:
            reasons.append(
                f"parallel.ep={self.ep} must divide parallel.dp x parallel.cp = "
                f"{self.dp * self.cp}: expert parallelism borrows its ranks from the "
                "data-parallel and context-parallel ranks, which hold different tokens"
            )
        if self.ep_first not in EP_FIRST:
            reasons.append(f"parallel.ep_first must be one of {EP_FIRST}, got {self.ep_first!r}")
        if self.sequence_parallel not in (None, True, False):
            reasons.append(
                f"parallel.sequence_parallel must be true, false or null, got "
                f"{self.sequence_parallel!r}"
            )
        elif self.sequence_parallel and self.tp == 1:
            reasons.append(
                "parallel.sequence_parallel=true needs parallel.tp > 1: it splits the tokens "
                "over the tensor-parallel ranks (null turns it on whenever tp > 1)"
            )
        if self.async_tp not in (True, False):
            reasons.append(f"parallel.async_tp must be true or false, got {self.async_tp!r}")
        elif self.async_tp and not self.sp:
            reasons.append(
                "parallel.async_tp=true needs sequence parallelism (parallel.tp > 1 with "
                "parallel.sequence_parallel on): the micro-pipeline TP pass fuses all-gather -> "
                "matmul and matmul -> reduce-scatter, and without SP the TP linears all-reduce"
            )
        if self.fsdp_backend not in FSDP_BACKENDS:
            reasons.append(
                f"parallel.fsdp_backend must be one of {FSDP_BACKENDS}, got {self.fsdp_backend!r}"
            )
        return reasons

    @property
    def batch(self) -> int:
        """Ranks holding different tokens of the global batch (TP peers hold the same)."""
        return self.dp_replicate * self.dp * self.cp

    @property
    def data_groups(self) -> int:
        """Data-parallel groups, each taking its own rows."""
        return self.dp_replicate * self.dp

    @property
    def efsdp(self) -> int:
        return self.dp * self.cp // self.ep

    @property
    def ep_factors(self) -> tuple[int, int]:
        """``(e_dp, e_cp)``: how many dp and cp ranks one EP group spans."""
        if self.ep_first == "cp":
            e_cp = math.gcd(self.ep, self.cp)
            return self.ep // e_cp, e_cp
        e_dp = math.gcd(self.ep, self.dp)
        return e_dp, self.ep // e_dp

    @property
    def group_sizes(self) -> dict[str, int]:
        """The size of each process group a rank joins through :meth:`build`'s meshes, by what
        it carries: the HSDP replicas, the dense FSDP shard group (``dp_shard × cp``), CP, TP,
        the loss group (``batch``), EP, the experts' FSDP group and the pipeline (a group of
        one rank costs nothing)."""
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard_cp": self.dp * self.cp,
            "cp": self.cp,
            "tp": self.tp,
            "batch": self.batch,
            "ep": self.ep,
            "efsdp": self.efsdp,
            "pp": self.pp,
        }

    def expert_grid(self, dense_ranks: torch.Tensor) -> torch.Tensor:
        """[dp_replicate, efsdp, ep, tp] rank ids from the dense mesh's rank tensor."""
        e_dp, e_cp = self.ep_factors
        r, d, c, t = self.dp_replicate, self.dp, self.cp, self.tp
        grid = dense_ranks.reshape(r, d // e_dp, e_dp, c // e_cp, e_cp, t)
        return grid.permute(0, 1, 3, 2, 4, 5).reshape(r, self.efsdp, self.ep, t)

    def build(self, device_type: str) -> Meshes:
        """Every mesh (all ranks must call it: each dim creates its process groups). Under PP
        each mesh is built over all stages (a leading ``pp`` dim) and sliced at this rank's."""
        _forget_earlier_meshes()
        a = MeshAxis
        pp, *shape = self.dense_shape  # (pp, dp_replicate, dp_shard, cp, tp)
        names = tuple(MeshAxis(d.axis) for d in RANK_DIMENSIONS[1:])
        if pp == 1:
            dense = init_device_mesh(device_type, shape, mesh_dim_names=names)
            staged = None
        else:
            staged = init_device_mesh(device_type, (pp, *shape), mesh_dim_names=(a.PP, *names))
            dense = staged[names]
        batch = flatten_mesh(dense, (a.DP_REPLICATE, a.DP_SHARD, a.CP), a.BATCH)
        shard = flatten_mesh(dense, (a.DP_SHARD, a.CP))
        expert = None
        expert_names = (a.DP_REPLICATE, a.EFSDP, a.EP, a.TP)
        if self.ep > 1 and staged is None:
            expert = DeviceMesh(
                device_type, self.expert_grid(dense.mesh), mesh_dim_names=expert_names
            )
        elif self.ep > 1:  # every stage's grid, so every rank makes the same groups
            grids = torch.stack([self.expert_grid(ranks) for ranks in staged.mesh])
            expert = DeviceMesh(device_type, grids, mesh_dim_names=(a.PP, *expert_names))
            expert = expert[expert_names]
        pp = None if staged is None else staged[a.PP]
        return Meshes(self, dense, batch, shard, expert, pp)

    @classmethod
    def from_recipe(cls, parallel: ParallelRecipe, world: int) -> ParallelDims:
        """The recipe's ``parallel`` section on ``world`` launched ranks."""
        return cls(parallel, launched=world)


_SETTINGS = frozenset(f.name for f in dataclasses.fields(ParallelRecipe))


def _forget_earlier_meshes() -> None:
    """Drop DTensor's cached sharding propagations before a run builds its meshes.

    A ``DeviceMesh`` equals (and hashes as) any mesh over the same ranks with the same dim
    names, whatever process groups stand behind it, and DTensor caches each op's output specs
    (mesh included) by its inputs' specs. In a process that trains a second time (``train()``
    called again, a test's next layout) an op on the new run's DTensors can return the earlier
    run's mesh object, with its groups; which ops hit depends on each rank's shard shapes, so the
    ranks of one group can end up on different groups for the same collective: megatron-fsdp
    HSDP after another run hung in the gradient-norm all-reduce, rank 0 on the earlier run's
    group and rank 1 on the new one. Emptied here, every cached spec is this run's."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
