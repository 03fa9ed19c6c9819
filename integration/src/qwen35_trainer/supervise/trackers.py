"""Where a run's scalars go besides ``metrics.jsonl``: the recipe's ``train.trackers``
(``tensorboard``, ``wandb``, ``mlflow``), written by rank 0 through
:class:`~qwen35_trainer.supervise.run_folder.RunFolder`.

Every tracker gets the same scalars at the same steps: :func:`scalars` maps one
``metrics.jsonl`` record to its named values (``train/<field>``, ``train/mtp_loss_<depth>``,
``eval/loss``, ``eval/accuracy``, ``eval/mtp_accuracy``; a ``null`` is not logged), so what a
tracker shows is what ``metrics.jsonl`` holds. W&B and MLflow also get the resolved recipe
(what ``recipe.yaml`` holds) as the run's config: W&B's ``config`` (updated at every start),
MLflow's params (``section.key``, JSON for non-strings) and a ``recipe.yaml`` artifact.

Restarts and resumes. The run folder is the run: ``trackers.json`` in it keeps the W&B run id
and the MLflow run id, and every later start of the folder (an elastic restart, the same command
run again) continues that tracked run instead of opening a new one.
- TensorBoard: a start's first step is its ``purge_step`` (``SummaryWriter``), so TensorBoard
  drops every earlier start's events from that step on and shows each step once, as
  :func:`~qwen35_trainer.supervise.run_folder.step_records` does (the last start's row wins).
- W&B and MLflow keep the FIRST value they got for a step: a continued run logs only the steps
  after the last one the run folder recorded before this start (W&B refuses steps below its
  last; MLflow would keep both values). A resume is exact, so the values of a repeated step are
  the same; only its timings differ. MLflow params cannot change: a setting changed on resume
  keeps its first value there (said in the log), and the ``recipe.yaml`` artifact is replaced.

Where they write: W&B in offline or online mode as ``WANDB_MODE`` says, under ``WANDB_DIR``
(else the run folder), in ``WANDB_PROJECT``; MLflow to ``MLFLOW_TRACKING_URI`` (a server, or a
local ``file:`` store, which MLflow 3 opens only with ``MLFLOW_ALLOW_FILE_STORE=true``), in the
experiment ``MLFLOW_EXPERIMENT_NAME`` (``Default`` if unset). Both are optional extras of the
trainer (``qwen35-trainer[wandb]``, ``[mlflow]``, which installs ``mlflow-skinny``), imported
only when named; :func:`require_trackers` refuses a missing one (every rank) before the first
step.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["flat_params", "open_trackers", "require_trackers", "scalars"]

_EVALS = {
    "eval_loss": "eval/loss",
    "eval_accuracy": "eval/accuracy",
    "eval_mtp_accuracy": "eval/mtp_accuracy",
}
# not logged as they are: the step is the x axis, the attempt bookkeeping, mtp_loss one per depth
_NOT_SCALARS = ("step", "attempt", "mtp_loss")
# the optional trackers: their module and the trainer's extra that installs it
_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
IDS_FILE = "trackers.json"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """``{name: value}`` of one ``metrics.jsonl`` record, as every tracker logs it."""
    out = {}
    for key, value in record.items():
        if value is None or key in _NOT_SCALARS:
            continue
        out[_EVALS.get(key, f"train/{key}")] = value
    for depth, value in enumerate(record.get("mtp_loss") or (), start=1):
        if value is not None:
            out[f"train/mtp_loss_{depth}"] = value
    return out


def require_trackers(names: tuple[str, ...]) -> None:
    """``ValueError`` naming the extra to install when a tracker's package is missing."""
    missing = [
        n for n in names if n in _PACKAGES and importlib.util.find_spec(_PACKAGES[n]) is None
    ]
    if missing:
        raise ValueError(
            "; ".join(
                f"train.trackers has {n!r} but the {_PACKAGES[n]} package is not installed: "
                f"pip install 'qwen35-trainer[{n}]'"
                for n in missing
            )
        )


def open_trackers(
    names: tuple[str, ...],
    folder: Path,
    config: dict[str, Any],
    recipe_text: str,
    logged_through: int,
    note: Callable[[str], None],
) -> list[Any]:
    """The trackers ``names`` of the run folder ``folder`` for this start: ``config`` the
    resolved recipe as a mapping, ``recipe_text`` the YAML of ``recipe.yaml``,
    ``logged_through`` the last step earlier starts recorded (0: none), ``note`` says a line
    in the run's log. Each has ``log(step, values)`` and ``close(ended)``."""
    require_trackers(names)
    ids_path = folder / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    opened: list[Any] = []
    for name in names:
        if name == "tensorboard":
            opened.append(_TensorBoard(folder / "tensorboard"))
            continue
        kind = _Wandb if name == "wandb" else _Mlflow
        tracker = kind(folder, config, recipe_text, ids.get(name), note)
        if ids.get(name) is not None:  # the run continues: it holds the earlier steps
            tracker.skip_through = logged_through
        ids[name] = tracker.run_id
        opened.append(tracker)
    if any(name in _PACKAGES for name in names):
        ids_path.write_text(json.dumps(ids, indent=1) + "\n")
    return opened


class _TensorBoard:
    """``tensorboard/`` event files; the writer opens at this start's first step, which
    purges every earlier start's events from that step on."""

    def __init__(self, path: Path) -> None:
        self.path, self.writer = path, None

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.path), purge_step=step)
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self, ended: str) -> None:
        if self.writer is not None:
            self.writer.close()


class _Continued:
    """What W&B and MLflow share: a continued run logs the steps after ``skip_through``."""

    skip_through = 0

    def log(self, step: int, values: dict[str, float]) -> None:
        if step > self.skip_through:
            self._log(step, values)


class _Wandb(_Continued):
    def __init__(self, folder, config, recipe_text, run_id, note) -> None:
        wandb = importlib.import_module("wandb")
        where = {} if os.environ.get("WANDB_DIR") else {"dir": str(folder)}
        try:
            self.run = wandb.init(id=run_id, resume="allow", name=folder.name, **where)
        except Exception as err:
            raise ValueError(
                f"train.trackers has 'wandb' but W&B could not start run {run_id or '(new)'} "
                f"(WANDB_MODE={os.environ.get('WANDB_MODE')!r}; expected a logged-in machine "
                f"(wandb login, WANDB_API_KEY) or WANDB_MODE=offline): {err}"
            ) from err
        self.run.config.update(config, allow_val_change=True)
        self.run_id = self.run.id

    def _log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, ended: str) -> None:
        if ended == "stopped":
            self.run.mark_preempting()
        self.run.finish(exit_code=1 if ended == "failed" else 0)


def _param(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The recipe as MLflow params: ``section.key`` (a nested section, ``model.lora.rank``)
    to its value (a string as is, anything else as JSON)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = _param(value)
    return out


class _Mlflow(_Continued):
    def __init__(self, folder, config, recipe_text, run_id, note) -> None:
        importlib.import_module("mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        try:
            self.client = MlflowClient()
            if run_id is None:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "Default")
                found = self.client.get_experiment_by_name(name)
                experiment = found.experiment_id if found else self.client.create_experiment(name)
                run_id = self.client.create_run(experiment, run_name=folder.name).info.run_id
            else:
                self.client.update_run(run_id, status="RUNNING")
        except Exception as err:
            raise ValueError(
                f"train.trackers has 'mlflow' but MLflow could not open a run at "
                f"MLFLOW_TRACKING_URI={uri!r} (expected a tracking server, or file:<folder> with "
                f"MLFLOW_ALLOW_FILE_STORE=true): {err}"
            ) from err
        self.run_id = run_id
        held = self.client.get_run(run_id).data.params
        params = flat_params(config)
        changed = sorted(k for k, v in params.items() if k in held and held[k] != v)
        new = [Param(k, v) for k, v in params.items() if k not in held]
        self.client.log_batch(run_id, params=new)
        self.client.log_text(run_id, recipe_text, "recipe.yaml")
        if changed:
            note(
                f"mlflow: run {run_id} keeps the first start's params {changed} (MLflow params "
                "cannot change); its recipe.yaml artifact is this start's recipe"
            )

    def _log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(key, float(value), stamp, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, ended: str) -> None:
        status = {"finished": "FINISHED", "stopped": "KILLED"}.get(ended, "FAILED")
        self.client.set_terminated(self.run_id, status=status)
