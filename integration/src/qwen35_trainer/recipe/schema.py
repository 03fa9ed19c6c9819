"""The recipe's schema: four frozen dataclasses, one per section (``model``:
:mod:`.model_schema`, ``data``: :mod:`.data_schema`, ``train`` and ``parallel`` here), each
checking its own values (every bad value of a section reported in one ``ValueError``), and the
derivations that belong to a section (``TrainRecipe.checkpoint_root``, ``ParallelRecipe.world``
/ ``filling``)."""

from __future__ import annotations

import dataclasses
import os

from qwen35_trainer.recipe.data_schema import DataRecipe
from qwen35_trainer.recipe.dimensions import product, world_size
from qwen35_trainer.recipe.model_schema import LoRARecipe, ModelRecipe
from qwen35_trainer.recipe.rules import refuse

__all__ = ["DataRecipe", "LoRARecipe", "ModelRecipe", "ParallelRecipe", "Recipe", "TrainRecipe"]


DTYPES = ("float32", "bfloat16")
EXPORT_FORMATS = (None, "peft", "per_expert", "merged")
ON_NONFINITE = ("stop", "skip")
SCHEDULES = ("constant", "linear", "cosine")
TRACKERS = ("tensorboard", "wandb", "mlflow")


@dataclasses.dataclass(frozen=True)
class TrainRecipe:
    """Optimisation. ``optimizer``: an Adam-family :func:`safe_optim.build_optimizer` name
    (``adamw``, ``adam``, ``te_fused_adam``; ``auto``: ``te_fused_adam`` where TransformerEngine
    imports, else ``adamw``), given ``lr``, ``betas``, ``eps``, ``weight_decay``. ``router_aux_loss_coef`` ``None`` takes the model
    config's value. ``activation_checkpointing``: recompute decoder (and trainable vision)
    blocks in backward (:func:`moe_parallel.apply_activation_checkpointing`).
    ``checkpoint_dir``: save there every ``checkpoint_every`` steps (0: only after the last) and
    resume from its newest intact checkpoint (:mod:`qwen35_trainer.train.resume`: every file is
    checked against the checkpoint's manifest before loading, sizes always and checksums unless
    ``verify_checkpoints`` is false; a damaged checkpoint is skipped with a warning).
    ``deterministic``: PyTorch's deterministic algorithms for the run, so the same recipe,
    launch and machine repeat bit for bit (:mod:`qwen35_trainer.train.determinism`; ``false`` trades
    that for speed on GPUs). ``on_nonfinite``: a step whose global loss or gradient norm is not
    finite is never applied;
    ``stop`` ends the run naming the step and its documents, ``skip`` drops the step and goes
    on, stopping after ``max_skipped_steps`` skipped steps in a row
    (:mod:`qwen35_trainer.train.nonfinite`).
    ``export_dir``: write the trained model there as a transformers checkpoint folder, beside
    the source's processor (:mod:`qwen35_trainer.train.export`); a folder that is not empty is
    refused before training starts unless ``export_overwrite``, which replaces the weights it
    holds; ``export_format``: ``peft``, ``per_expert`` or ``merged`` (``None``: ``peft`` for a
    LoRA run, else the merged weights); ``export_base``: the base a LoRA export names
    (``base_model_name_or_path``; ``None``: ``model.path`` as the recipe wrote it). ``dtype``:
    ``float32``, or ``bfloat16`` parameters and compute with fp32 master weights and fp32
    gradient reduction (FSDP2 mixed precision; loss, router and Gated DeltaNet statistics stay
    fp32). ``grad_accum_steps``: micro-batches per optimizer step (each rank's samples split
    evenly), normalised by the step's global valid-label count. ``schedule``: ``constant``,
    ``linear`` or ``cosine`` decay of the learning rate from ``lr`` after ``warmup_steps``
    linear warmup steps down to ``lr_floor * lr`` (:mod:`qwen35_trainer.train.schedule`).
    ``keep_checkpoints``: keep only the newest that many (0: all). ``eval_every``: every that
    many steps (and after the last), the loss on ``eval_steps`` held-out global batches. ``async_checkpoint``: write checkpoints in the background (the state is copied to host
    memory, the next save or the end of the run completes it; :class:`qwen35_trainer.train.checkpoint.
    AsyncCheckpointer`). ``prewarm``: before the first step, initialise cuBLAS, the communicators of every mesh and
    fla's kernels (:func:`setup_prewarm.prewarm`, best-effort; its report is logged).
    ``output_dir``: the run folder (resolved recipe, ``metrics.jsonl``, TensorBoard events,
    ``loss.png``, per-rank logs; :mod:`qwen35_trainer.supervise.run_folder`); ``None`` writes none.
    ``trackers``: where rank 0 also logs every step's scalars, among ``tensorboard``, ``wandb``
    and ``mlflow`` (optional extras; a restarted or resumed run continues the same tracked run;
    :mod:`qwen35_trainer.supervise.trackers`); ``[]``: ``metrics.jsonl`` alone.
    ``mtp_loss_weight``: with a multi-token-prediction head (``model.mtp_layers``), its
    cross-entropy (mean over depths, each normalised by its own valid targets) is added to the
    loss with this weight (0.1, Megatron-Bridge's default). ``hang_timeout``: seconds without
    progress (a step, an evaluation, a checkpoint, the setup before the first step) after which
    every live rank writes its Python stacks to ``<output_dir>/hang/`` and the job exits 6
    (:mod:`qwen35_trainer.supervise.watchdog`); 0 turns the watchdog off. ``stop_timeout``:
    seconds the built-in launcher gives its workers, after forwarding a stop signal, to finish
    the step and save before it kills them (:mod:`qwen35_trainer.supervise.agent`)."""

    steps: int = 10
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    seed: int = 0
    loss_chunk_size: int | None = None
    router_aux_loss_coef: float | None = None
    activation_checkpointing: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    export_dir: str | None = None
    export_overwrite: bool = False
    export_format: str | None = None
    export_base: str | None = None
    log_every: int = 1
    dtype: str = "float32"
    grad_accum_steps: int = 1
    schedule: str = "constant"
    warmup_steps: int = 0
    lr_floor: float = 0.0
    output_dir: str | None = None
    trackers: tuple[str, ...] = ("tensorboard",)
    keep_checkpoints: int = 0
    eval_every: int = 0
    eval_steps: int = 1
    prewarm: bool = False
    async_checkpoint: bool = False
    verify_checkpoints: bool = True
    on_nonfinite: str = "stop"
    max_skipped_steps: int = 5
    deterministic: bool = True
    mtp_loss_weight: float = 0.1
    compile: bool = False
    hang_timeout: float = 1800.0
    stop_timeout: float = 600.0

    @property
    def checkpoint_root(self) -> str | None:
        """Where the run's checkpoints go: ``checkpoint_dir``, else ``<output_dir>/checkpoints``
        when the run folder exists and ``checkpoint_every`` asks for checkpoints, else none."""
        if self.checkpoint_dir is None and self.output_dir and self.checkpoint_every:
            return os.path.join(self.output_dir, "checkpoints")
        return self.checkpoint_dir

    def __post_init__(self) -> None:
        b1, b2 = self.betas
        refuse(
            "train",
            {
                "steps": (self.steps >= 1, ">= 1"),
                "lr": (self.lr >= 0, ">= 0"),
                "weight_decay": (self.weight_decay >= 0, ">= 0"),
                "betas": (0 <= b1 < 1 and 0 <= b2 < 1, "two values in [0, 1)"),
                "eps": (self.eps > 0, "> 0"),
                "grad_clip": (
                    self.grad_clip is None or self.grad_clip > 0,
                    "> 0, or null to measure the norm without clipping (0 would zero every "
                    "gradient, a negative value reverse them)",
                ),
                "loss_chunk_size": (
                    self.loss_chunk_size is None or self.loss_chunk_size >= 1,
                    ">= 1 or null",
                ),
                "router_aux_loss_coef": (
                    self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
                    ">= 0 or null",
                ),
                "log_every": (self.log_every >= 1, ">= 1"),
                "dtype": (self.dtype in DTYPES, f"one of {DTYPES}"),
                "grad_accum_steps": (self.grad_accum_steps >= 1, ">= 1"),
                "schedule": (self.schedule in SCHEDULES, f"one of {SCHEDULES}"),
                "warmup_steps": (0 <= self.warmup_steps <= self.steps, "in [0, train.steps]"),
                "lr_floor": (0 <= self.lr_floor <= 1, "in [0, 1] (a fraction of train.lr)"),
                "keep_checkpoints": (self.keep_checkpoints >= 0, ">= 0 (0 keeps every checkpoint)"),
                "eval_every": (self.eval_every >= 0, ">= 0 (0: no evaluation)"),
                "eval_steps": (self.eval_steps >= 1, ">= 1"),
                "trackers": (
                    set(self.trackers) <= set(TRACKERS)
                    and len(set(self.trackers)) == len(self.trackers),
                    f"a list of distinct names among {list(TRACKERS)} ([]: none)",
                ),
                "on_nonfinite": (self.on_nonfinite in ON_NONFINITE, f"one of {ON_NONFINITE}"),
                "max_skipped_steps": (self.max_skipped_steps >= 1, ">= 1"),
                "mtp_loss_weight": (self.mtp_loss_weight >= 0, ">= 0"),
                "hang_timeout": (self.hang_timeout >= 0, ">= 0 seconds (0: no watchdog)"),
                "stop_timeout": (self.stop_timeout > 0, "> 0 seconds"),
                "checkpoint_every": (self.checkpoint_every >= 0, ">= 0"),
                "export_format": (
                    self.export_format in EXPORT_FORMATS,
                    f"one of {EXPORT_FORMATS} (null: peft for a LoRA run, else merged)",
                ),
            },
            self,
        )


@dataclasses.dataclass(frozen=True)
class ParallelRecipe:
    """``dp``: FSDP-sharded data-parallel groups, each with its own rows; ``dp_replicate``:
    HSDP replicas of those (each its own rows too); ``cp``: context-parallel ranks per group,
    sharing one packed row (needs ``data.packing``); ``tp``: tensor-parallel ranks holding the
    same tokens (attention heads and the shared expert split). The world size is
    ``dp_replicate * dp * cp * tp``. ``ep``: expert-parallel ranks, borrowed from the ``dp * cp``
    ranks (it must divide ``dp * cp`` and every MoE's expert count); ``ep_first``: which of
    ``cp`` / ``dp`` an EP group takes its ranks from first (``cp``: EP groups inside one CP
    group while ``ep <= cp``). The dimensions are named once in
    :mod:`qwen35_trainer.recipe.dimensions`; the runtime layout is
    :class:`qwen35_trainer.parallel.ParallelDims`.

    ``sequence_parallel``: between the TP regions each TP rank holds 1/tp of the tokens
    (:mod:`qwen35_trainer.parallel.sequence_parallel`); ``None`` turns it on whenever
    ``tp > 1``. ``async_tp``: overlap the TP all-gathers / reduce-scatters with the projections'
    matmuls (async-tp-linear and Inductor's micro-pipeline TP; needs SP, CUDA with NCCL, and
    compiles the blocks). ``fsdp_backend``: ``fsdp2`` or ``megatron`` (megatron-fsdp through
    :func:`fsdp_compat.shard_model`; CUDA only).

    ``pp``: pipeline stages, the outermost dim: each stage's ranks form the layout above, so the
    world is ``pp`` times it. ``pp_schedule``: one of torch's pipeline schedules
    (:data:`qwen35_trainer.parallel.pipeline_split.PP_SCHEDULES`); ``pp_virtual_stages``: stages
    per rank (interleaved schedules: 2 or more); ``pp_microbatches``: the schedule's
    micro-batches, ``train.grad_accum_steps`` (``None``: that); ``pp_layers``: how many decoder
    layers each of the ``pp * pp_virtual_stages`` stages holds, in order (``None``: balanced by
    each layer's cost, :mod:`qwen35_trainer.parallel.pipeline_split`)."""

    dp: int = 1
    dp_replicate: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    ep_first: str = "cp"
    sequence_parallel: bool | None = None
    async_tp: bool = False
    fsdp_backend: str = "fsdp2"
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    pp_microbatches: int | None = None
    pp_layers: tuple[int, ...] | None = None

    @property
    def sp(self) -> bool:
        """Whether the run is sequence-parallel: ``sequence_parallel``, else ``tp > 1``."""
        if self.sequence_parallel is None:
            return self.tp > 1
        return bool(self.sequence_parallel) and self.tp > 1

    @property
    def world(self) -> int:
        """The ranks the layout needs: the product of the degrees that add ranks
        (:mod:`qwen35_trainer.recipe.dimensions`: ``pp * dp_replicate * dp * cp * tp``)."""
        return world_size(self)

    def filling(self, world: int, what: str) -> ParallelRecipe:
        """This layout with ``dp`` chosen so it fills ``world`` ranks (every other degree
        kept); ``ValueError`` naming ``what`` asked for it (``--nproc``, ``--world-size``) when
        no data-parallel degree does."""
        per_dp = world_size(self, without=("dp",))
        if world < 1 or world % per_dp:
            keys = product(self, form="{key}", without=("dp",))
            values = product(self, form="{value}", without=("dp",))
            raise ValueError(
                f"{what} {world} is not a multiple of parallel.{keys} = {values} = {per_dp} "
                "(kept fixed), so no data-parallel degree fills it"
            )
        return dataclasses.replace(self, dp=world // per_dp)


@dataclasses.dataclass(frozen=True)
class Recipe:
    model: ModelRecipe
    data: DataRecipe = dataclasses.field(default_factory=DataRecipe)
    train: TrainRecipe = TrainRecipe()
    parallel: ParallelRecipe = ParallelRecipe()
