"""Find, check and load checkpoints (:mod:`qwen35_trainer.train.checkpoint` writes them).

A checkpoint is proven before it is loaded: its files are checked against its manifest (sizes
always, checksums unless turned off), every rank checking its share of the files and all ranks
agreeing on the verdict (:func:`agreed_verdict`). Resuming from a checkpoint directory takes the
newest checkpoint that is intact (:func:`newest_loadable`: a damaged one is skipped with a
warning that says which file is wrong and how); an explicitly named checkpoint that is damaged
is an error (:class:`DamagedCheckpointError`). Before reading, the model's tensor names and
shapes are compared with the checkpoint's metadata, so "a checkpoint of another model" is said
only when it is one, naming the tensors; a failure while reading says what failed. Reading runs
no foreign code (:mod:`qwen35_trainer.train.safe_load`).

Why a resumed run continues exactly: the model and optimizer tensors are restored bit for bit,
the data stream continues from its saved cursors (or is a pure function of the step), and
nothing else in a step is random (the model has no dropout; the expert dispatch is
deterministic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fsdp_compat import dcp_ready
from qwen35_trainer.data.feed import Feed
from qwen35_trainer.model.whole import Elsewhere
from qwen35_trainer.parallel.dist import all_ranks, rank, world
from qwen35_trainer.train.integrity import DAMAGED, Verdict, verify
from qwen35_trainer.train.safe_load import (
    UNSAFE_ITEM,
    SafePlanner,
    SafeReader,
    UnsafeCheckpointError,
)

__all__ = [
    "DATA_STATE",
    "RESUMABLE_CHANGES",
    "DamagedCheckpointError",
    "UnsafeCheckpointError",
    "agreed_verdict",
    "changed_on_resume",
    "checkpoints_in",
    "load_checkpoint",
    "load_model_weights",
    "newest_checkpoint",
    "newest_loadable",
    "restore_data_state",
    "resume_point",
]

DATA_STATE = "data_state.json"  # a run's dataset position (Feed.state_dict), with its checkpoint


def restore_data_state(feed: Feed, checkpoint: Path) -> None:
    """Continue ``feed``'s dataset where the checkpoint's run stopped (nothing to do for the
    synthetic stream); ``ValueError`` naming the file when it is missing or does not fit."""
    if feed.stream is None:
        return
    file = checkpoint / DATA_STATE
    if not file.is_file():
        raise ValueError(
            f"{checkpoint} has no {DATA_STATE}: it was saved by a run without a dataset, so "
            "where to continue in this one is unknown"
        )
    try:
        feed.load_state_dict(json.loads(file.read_text()))
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from error


_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class DamagedCheckpointError(ValueError):
    """A checkpoint's files do not match its manifest (or no intact checkpoint is left)."""


@contextlib.contextmanager
def one_process_is_intended():
    """DCP warns that it assumes a single process when no group exists; here that is the case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def checkpoints_in(checkpoint_dir: str | Path) -> list[tuple[int, Path]]:
    """Every checkpoint under ``checkpoint_dir`` with a final name (``step_NNNNNN``, not
    ``.partial``), newest first, as ``(step, path)``; intact or not."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def newest_checkpoint(checkpoint_dir: str | Path | None) -> int | None:
    """The step of the newest checkpoint under ``checkpoint_dir`` with a final name (what a
    restart resumes from unless it is damaged); ``None`` when there is none."""
    if checkpoint_dir is None or not Path(checkpoint_dir).is_dir():
        return None
    found = checkpoints_in(checkpoint_dir)
    return found[-1][0] if found else None


def agreed_verdict(path: Path, *, checksums: bool = True) -> Verdict:
    """The verdict on ``path`` that every rank returns: each rank checks every file's size and
    hashes every ``world``-th file; the verdicts are gathered (one collective) and combined —
    damaged when any rank found damage, with every rank's problems."""
    local = verify(path, checksums=checksums, share=(rank(), world()))
    verdicts = all_ranks(local)
    damaged = [v for v in verdicts if v.state == DAMAGED]
    if not damaged:
        return local
    problems = dict.fromkeys(p for v in damaged for p in v.problems)  # sizes: seen by every rank
    return Verdict(Path(path), DAMAGED, tuple(problems))


def newest_loadable(
    checkpoint_dir: str | Path, *, checksums: bool = True
) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``checkpoint_dir`` that is intact (or has no manifest, being
    older than manifests), the same on every rank, and the warnings for the newer ones skipped
    as damaged. ``(None, [])`` when there is no checkpoint; :class:`DamagedCheckpointError` when
    every checkpoint there is damaged; ``ValueError`` when the ranks see different checkpoints
    (not one shared directory)."""
    found = checkpoints_in(checkpoint_dir)
    _same_on_every_rank(checkpoint_dir, found)
    warnings_: list[str] = []
    for _, path in found:
        verdict = agreed_verdict(path, checksums=checksums)
        if verdict.loadable:
            return path, warnings_
        warnings_.append(
            f"checkpoint {path} is damaged, resuming from an older one: "
            + "; ".join(verdict.problems)
        )
    if found:
        raise DamagedCheckpointError(
            f"every checkpoint under {checkpoint_dir} is damaged ({'; '.join(warnings_)}); "
            "move them away (or point train.checkpoint_dir elsewhere) to start afresh"
        )
    return None, []


def _same_on_every_rank(checkpoint_dir, found: list[tuple[int, Path]]) -> None:
    """``ValueError`` on every rank unless all see the same newest checkpoint and count."""
    everyone = all_ranks((found[0][0] if found else -1, len(found)))
    if len(set(everyone)) > 1:
        raise ValueError(
            f"ranks see different checkpoints under {checkpoint_dir} (newest step, count per "
            f"rank: {everyone}; -1 = none): it must be one shared directory"
        )


# A checkpoint holds what trains: the frozen weights of a LoRA run are the base checkpoint's
# (``model.path``, named by the recipe saved beside), read again when the run is built. Loading
# sets the trained parameters only (every one of them must be in the checkpoint: DCP's read
# fails on a missing one before anything is set). The optimizer state is keyed by parameter
# name throughout (flattened: each parameter's hyperparameters under its own name, not one
# param-group list per rank), so pipeline stages, which hold different parameters, write
# disjoint keys and any ``pp`` reads them; a checkpoint written before (one list per group,
# ``optim.param_groups.0...``) is still read in its own form.
SAVED = StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True)
LOADED = StateDictOptions(
    ignore_frozen_params=True, strict=False, flatten_optimizer_state_dict=True
)
SAVED_NESTED = StateDictOptions(ignore_frozen_params=True)
LOADED_NESTED = StateDictOptions(ignore_frozen_params=True, strict=False)


def sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, options: Any = SAVED
) -> tuple:
    """``(model state, optimizer state)`` by parameter name (no optimizer: ``None``) — the
    parameters that train, :data:`SAVED` —, their DTensors describing their true blocks for
    DCP (megatron-fsdp's uneven shards included, :func:`fsdp_compat.dcp_ready`; megatron-fsdp's
    own hooks put its distributed parameters in place for ``state_dict`` and install the loaded
    ones for compute after ``load_state_dict``)."""
    if optimizer is None:
        model_state, optim_state = get_model_state_dict(model, options=options), None
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
    dcp_ready(_sharded(model), model_state, *([optim_state] if optim_state else []))
    return model_state, optim_state


def _sharded(model: nn.Module) -> nn.Module:
    return getattr(model, "megatron", None) or model


def _elsewhere(model: nn.Module) -> tuple[str, ...]:
    """The name prefixes of the modules other pipeline stages hold (none without PP)."""
    return tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, Elsewhere))


def _check_model_shapes(
    path: Path, reader: SafeReader, model_state: dict, elsewhere: tuple[str, ...] = ()
) -> None:
    """``ValueError`` naming every model tensor whose shape differs from the checkpoint's, or
    that only one side has (the same verdict on every rank: global shapes, shared metadata).
    ``elsewhere``: the prefixes of what other pipeline stages hold: a checkpoint tensor under
    one is theirs to read, not missing here (the stages partition the model, so every
    checkpoint tensor is still checked by exactly one stage)."""
    saved = {
        fqn.removeprefix("model."): tuple(meta.size)
        for fqn, meta in reader.read_metadata().state_dict_metadata.items()
        if fqn.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    ours = {name: tuple(value.shape) for name, value in model_state.items()}
    problems = [
        f"{name}: {list(saved[name])} in the checkpoint, {list(shape)} in this model"
        for name, shape in ours.items()
        if name in saved and saved[name] != shape
    ]
    problems += [f"{name}: in this model, not in the checkpoint" for name in ours.keys() - saved]
    problems += [
        f"{name}: in the checkpoint, not in this model"
        for name in saved.keys() - ours
        if not name.startswith(elsewhere)
    ]
    if problems:
        more = f" ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise ValueError(
            f"checkpoint {path} holds a model of another shape ({len(problems)} tensor(s) "
            f"differ): {'; '.join(sorted(problems)[:5])}{more}"
        )


def _nested_optimizer(path: Path) -> bool:
    """Whether the checkpoint at ``path`` keeps its optimizer's param groups as a list (written
    before the state was keyed by parameter name, :data:`SAVED`)."""
    keys = SafeReader(str(path)).read_metadata().state_dict_metadata
    return any(key.startswith("optim.param_groups.0.") for key in keys)


def _read(
    path: Path, state: dict, *, partial: bool = False, elsewhere: tuple[str, ...] = ()
) -> None:
    """``state`` filled in place from the DCP checkpoint at ``path``: safe metadata and model
    shapes checked first (``elsewhere``: :func:`_check_model_shapes`); ``partial``: only the
    items ``state`` names."""
    _check_model_shapes(path, SafeReader(str(path)), state["model"], elsewhere)
    try:
        with one_process_is_intended():
            dcp.load(
                state,
                storage_reader=SafeReader(str(path)),
                planner=SafePlanner(allow_partial_load=partial),
                no_dist=not dist.is_initialized(),
            )
    except (Exception, CheckpointException) as err:  # DCP's wraps each rank's failure
        reason = str(err).strip().splitlines()[-1]  # the wrapped error's own line
        if UNSAFE_ITEM in str(err):
            raise UnsafeCheckpointError(f"{path}: {reason}") from err
        raise ValueError(
            f"checkpoint {path}: reading it failed ({type(err).__name__}: {reason})"
        ) from err


def _verified(path: str | Path, checksums: bool) -> Path:
    """``path``, after every rank agreed it may be loaded (else :class:`DamagedCheckpointError`)."""
    verdict = agreed_verdict(Path(path), checksums=checksums)
    if not verdict.loadable:
        raise DamagedCheckpointError(f"checkpoint {path} is {verdict.describe()}")
    return Path(path)


def load_model_weights(path: str | Path, model: nn.Module, *, checksums: bool = True) -> int:
    """Restore only ``model``'s weights from the checkpoint at ``path`` (any layout: DCP
    re-shards), verified first; returns its finished steps."""
    path = _verified(path, checksums)
    state = {"model": sharded_state(model, None)[0], "step": torch.tensor(0)}
    _read(path, state, partial=True, elsewhere=_elsewhere(model))
    set_model_state_dict(model, state["model"], options=LOADED)
    return int(state["step"])


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    checksums: bool = True,
    verified: bool = False,
) -> int:
    """Restore ``model`` and ``optimizer`` in place from ``path``, verified first unless the
    caller already did (``verified``); returns the finished steps."""
    path = Path(path) if verified else _verified(path, checksums)
    nested = _nested_optimizer(path)
    model_state, optim_state = sharded_state(model, optimizer, SAVED_NESTED if nested else SAVED)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
    _read(path, state, elsewhere=_elsewhere(model))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=LOADED_NESTED if nested else LOADED,
    )
    return int(state["step"])


# Recipe values that may change between a checkpoint and its resumption (re-applied from the
# recipe the run is started with, not taken from the checkpoint).
RESUMABLE_CHANGES = ("lr", "schedule", "warmup_steps", "lr_floor", "steps")


def changed_on_resume(path: Path, recipe: Any) -> list[str]:
    """One line per :data:`RESUMABLE_CHANGES` value that differs from the checkpoint's recipe."""
    saved = path / "recipe.yaml"
    if not saved.is_file():
        return []
    before = yaml.safe_load(saved.read_text()).get("train", {})
    now = dataclasses.asdict(recipe.train)
    return [
        f"train.{k} changed on resume: {before[k]!r} -> {now[k]!r} (the new value applies)"
        for k in RESUMABLE_CHANGES
        if k in before and before[k] != now[k]
    ]


def resume_point(checkpoints: str | None, objective, optimizer, checksums: bool):
    """``(steps already done, messages)``: 0, or those of the newest loadable checkpoint under
    ``checkpoints`` (the same on every rank; newer damaged ones skipped, each with a warning
    among the messages)."""
    if not checkpoints:
        return 0, []
    path, warnings = newest_loadable(checkpoints, checksums=checksums)
    if path is None:
        return 0, warnings
    return load_checkpoint(path, objective, optimizer, verified=True), warnings
