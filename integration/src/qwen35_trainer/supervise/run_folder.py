"""The run folder: what a run leaves behind for people to watch and compare.

``train.output_dir`` holds ``recipe.yaml`` (the resolved recipe: every default filled in, so the
run can be repeated from it alone; comments above it name the kernel each layer kind ran),
``metrics.jsonl`` (below), the trackers' files (``train.trackers``,
:mod:`qwen35_trainer.supervise.trackers`: TensorBoard event files under ``tensorboard/`` by
default, W&B / MLflow run ids in ``trackers.json``), ``loss.png`` (train and held-out loss
curves of the whole run, matplotlib; rewritten at every evaluation and at the end) and
``logs/rank<R>.log`` (every rank's step lines, so a failing rank's history is there). Rank 0
writes everything but its peers' logs; a metric that is not measured on this machine (CUDA
memory on CPU) is ``null``, never a made-up number.

``metrics.jsonl``: a ``{"header": {"attempt": A, "kernels": ...}}`` record each time a run
starts in the folder, then one JSON object per optimizer step whose ``attempt`` is A. The
attempt of a start is the number of header records the file already holds: the number of
earlier starts of this run folder, whatever started them (an elastic restart of the workers,
``TORCHELASTIC_RESTART_COUNT``, or the same command run again), counted from 0. A start
resumes from the newest checkpoint, so it may repeat steps an earlier attempt recorded.

The rule every reader applies (:func:`step_records`, which the package's readers call): an
attempt's rows replace every earlier attempt's rows from its first step on. So a step's record
is the row of the last attempt that recorded it, and the rows an earlier attempt wrote after a
later attempt's first step are dropped with them (a trajectory no later attempt continued). Why
this is the run's history: attempt k+1 starts from a checkpoint of step s - 1 and recomputes
steps s, s + 1, ... from it, so its rows, not attempt k's, continue from what the checkpoint
holds; TensorBoard's ``purge_step`` (the trackers) applies the same cut. A line becomes a record
once its newline is written: a last line without one (being written, or cut by a killed
process) is not read, and the next start removes it before appending its header.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

from qwen35_trainer.supervise.metrics import StepLog
from qwen35_trainer.supervise.preemption import Preempted
from qwen35_trainer.supervise.trackers import open_trackers, require_trackers, scalars

__all__ = ["RunFolder", "recipe_yaml", "resolved_recipe", "step_records"]


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _lines(path: Path) -> list[str]:
    """The complete lines of ``path`` (those with their newline), blank ones left out."""
    return [line for line in path.read_text().split("\n")[:-1] if line.strip()]


def step_records(path: str | Path) -> list[dict[str, Any]]:
    """The run's step records of a ``metrics.jsonl``, one per step in step order, by the rule
    of the module docstring (a later attempt's rows replace an earlier attempt's from its first
    step on). A row without ``attempt`` (written before rows carried it) belongs to the start
    of the header above it."""
    attempts: dict[int, list[dict[str, Any]]] = {}
    headers = 0
    for record in map(json.loads, _lines(Path(path))):
        if "header" in record:
            headers += 1
            continue
        attempts.setdefault(record.get("attempt", headers - 1), []).append(record)
    kept: dict[int, dict[str, Any]] = {}
    cut = math.inf  # the first step of the attempts after this one
    for attempt in sorted(attempts, reverse=True):
        rows = attempts[attempt]
        kept.update({r["step"]: r for r in rows if r["step"] < cut})
        cut = min(cut, *(r["step"] for r in rows))
    return [kept[step] for step in sorted(kept)]


def resolved_recipe(recipe: Any) -> str:
    """The recipe as YAML with every default filled in (loads back to the same recipe)."""
    return yaml.safe_dump(_plain(dataclasses.asdict(recipe)), sort_keys=False)


def recipe_yaml(recipe: Any, kernels: dict[str, str] | None = None) -> str:
    """The run folder's ``recipe.yaml``: :func:`resolved_recipe` under comments naming the
    kernel each layer kind ran (``kernels``, :meth:`~qwen35_trainer.model.kernels.Kernels.
    record`). Comments, so the file loads back to the same recipe (``auto`` stays ``auto``).
    ``qwen35-train show`` prints the same text (:mod:`qwen35_trainer.cli_info`)."""
    said = "".join(f"#   {kind}: {name}\n" for kind, name in (kernels or {}).items())
    if said:
        said = "# kernels this run ran (model.*_backend, train.optimizer resolved):\n" + said
    return said + resolved_recipe(recipe)


def _start_attempt(path: Path) -> int:
    """This start's attempt (the header records ``path`` holds), after removing a last line cut
    by a killed start, so the header this start appends begins its own line."""
    if not path.is_file():
        return 0
    text = path.read_bytes()
    complete = text[: text.rfind(b"\n") + 1]
    if len(complete) != len(text):
        with open(path, "r+b") as file:
            file.truncate(len(complete))
    return sum(line.startswith(b'{"header"') for line in complete.split(b"\n"))


class RunFolder:
    """Writes one run's folder; ``rank``: this process's global rank (0 writes the shared
    files and feeds the trackers)."""

    def __init__(
        self, path: str | Path, recipe: Any, rank: int = 0, *, kernels: dict | None = None
    ) -> None:
        self.path, self.rank = Path(path), rank
        require_trackers(recipe.train.trackers)  # every rank: all refuse alike, before any step
        (self.path / "logs").mkdir(parents=True, exist_ok=True)
        self.log = open(self.path / "logs" / f"rank{rank}.log", "a")  # noqa: SIM115
        self.metrics, self.trackers, self.attempt = None, [], 0
        if rank == 0:
            text = recipe_yaml(recipe, kernels)
            (self.path / "recipe.yaml").write_text(text)
            metrics = self.path / "metrics.jsonl"
            self.attempt = _start_attempt(metrics)
            earlier = step_records(metrics) if self.attempt else []
            self.metrics = open(metrics, "a")  # noqa: SIM115
            header = {"attempt": self.attempt, "kernels": kernels or {}}
            self.metrics.write(json.dumps({"header": header}) + "\n")
            self.metrics.flush()
            self.trackers = open_trackers(
                recipe.train.trackers,
                self.path,
                yaml.safe_load(text),
                text,
                earlier[-1]["step"] if earlier else 0,
                self.note,
            )

    def note(self, message: str) -> None:
        """A line in this rank's log (e.g. "resumed from step 6")."""
        self.log.write(message + "\n")
        self.log.flush()

    def record(self, log: StepLog) -> None:
        """One optimizer step's record (:meth:`StepLog.metrics`, and rank 0 adds this start's
        ``attempt`` in ``metrics.jsonl``), given to every tracker."""
        metrics = log.metrics()
        self.note(json.dumps(metrics))
        if self.rank != 0:
            return
        metrics["attempt"] = self.attempt
        self.metrics.write(json.dumps(metrics) + "\n")
        self.metrics.flush()
        values = scalars(metrics)
        for tracker in self.trackers:
            tracker.log(metrics["step"], values)
        if metrics["eval_loss"] is not None:
            self.plot()  # refreshed at every eval

    def plot(self) -> None:
        """``loss.png`` of the whole run: every attempt's records, by :func:`step_records`."""
        records = step_records(self.path / "metrics.jsonl")
        if records:
            plot_loss(records, self.path / "loss.png")

    def close(self) -> None:
        """Flush everything, draw ``loss.png`` and end the trackers' runs (rank 0): failed when
        called while an exception propagates (a ``finally``), stopped on :class:`Preempted`."""
        self.log.close()
        if self.rank != 0:
            return
        self.metrics.close()
        raised = sys.exc_info()[1]
        ended = "finished" if raised is None else "failed"
        ended = "stopped" if isinstance(raised, Preempted) else ended
        for tracker in self.trackers:
            tracker.close(ended)
        self.plot()


def plot_loss(records: list[dict[str, Any]], path: Path) -> None:
    """The loss and cross-entropy per step (and each MTP depth's cross-entropy when the run
    trains the MTP head), saved as a PNG (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["loss"] for r in records], label="loss (train)")
    ax.plot(steps, [r["ce"] for r in records], label="cross-entropy (train)", alpha=0.7)
    depths = len(records[-1].get("mtp_loss") or ())
    for d in range(depths):
        mtp = [(r["step"], r["mtp_loss"][d]) for r in records if r.get("mtp_loss")]
        ax.plot(*zip(*mtp, strict=True), label=f"MTP depth {d + 1} (train)", alpha=0.7)
    evals = [(r["step"], r["eval_loss"]) for r in records if r["eval_loss"] is not None]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="loss (held-out)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
