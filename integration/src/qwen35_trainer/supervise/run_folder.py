"""The run folder: what a run leaves behind for people to watch and compare.

``train.output_dir`` holds ``recipe.yaml`` (the resolved recipe: every default filled in, so the
run can be repeated from it alone; comments above it name the kernel each layer kind ran),
``metrics.jsonl`` (a ``{"header": {"kernels": ...}}`` record each time a run starts, then one
JSON object per optimizer step: :func:`step_records` reads them back),
TensorBoard event files under ``tensorboard/`` (``torch.utils.tensorboard``), ``loss.png``
(train and held-out loss curves, matplotlib; rewritten at every evaluation and at the end) and ``logs/rank<R>.log`` (every
rank's step lines, so a failing rank's history is there). Rank 0 writes everything but its
peers' logs; a metric that is not measured on this machine (CUDA memory on CPU) is ``null``,
never a made-up number.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from qwen35_trainer.train.metrics import StepLog

__all__ = ["RunFolder", "recipe_yaml", "resolved_recipe", "step_records"]


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def step_records(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a ``metrics.jsonl`` (its header records left out)."""
    lines = Path(path).read_text().splitlines()
    return [r for r in map(json.loads, filter(str.strip, lines)) if "header" not in r]


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


class RunFolder:
    """Writes one run's folder; ``rank``: this process's global rank (0 writes the shared
    files)."""

    def __init__(
        self, path: str | Path, recipe: Any, rank: int = 0, *, kernels: dict | None = None
    ) -> None:
        self.path, self.rank = Path(path), rank
        (self.path / "logs").mkdir(parents=True, exist_ok=True)
        self.log = open(self.path / "logs" / f"rank{rank}.log", "a")  # noqa: SIM115
        self.records: list[dict[str, Any]] = []
        self.metrics = self.board = None
        if rank == 0:
            (self.path / "recipe.yaml").write_text(recipe_yaml(recipe, kernels))
            self.metrics = open(self.path / "metrics.jsonl", "a")  # noqa: SIM115
            # a header record each time a run starts (a resumed run appends its own)
            self.metrics.write(json.dumps({"header": {"kernels": kernels or {}}}) + "\n")
            self.metrics.flush()
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(self.path / "tensorboard"))

    def note(self, message: str) -> None:
        """A line in this rank's log (e.g. "resumed from step 6")."""
        self.log.write(message + "\n")
        self.log.flush()

    def record(self, log: StepLog) -> None:
        """One optimizer step's record (:meth:`StepLog.metrics`)."""
        metrics = log.metrics()
        self.note(json.dumps(metrics))
        if self.rank != 0:
            return
        self.records.append(metrics)
        self.metrics.write(json.dumps(metrics) + "\n")
        self.metrics.flush()
        evals = ("eval_loss", "eval_accuracy", "eval_mtp_accuracy")
        for key, value in metrics.items():
            if key == "mtp_loss" and value is not None:  # one curve per depth
                for depth, v in enumerate(value, start=1):
                    if v is not None:
                        self.board.add_scalar(f"train/mtp_loss_{depth}", v, metrics["step"])
            elif key not in ("step", "mtp_loss", *evals) and value is not None:
                self.board.add_scalar(f"train/{key}", value, metrics["step"])
        if metrics["eval_loss"] is not None:
            self.board.add_scalar("eval/loss", metrics["eval_loss"], metrics["step"])
            self.board.add_scalar("eval/accuracy", metrics["eval_accuracy"], metrics["step"])
            if metrics["eval_mtp_accuracy"] is not None:
                self.board.add_scalar(
                    "eval/mtp_accuracy", metrics["eval_mtp_accuracy"], metrics["step"]
                )
            plot_loss(self.records, self.path / "loss.png")  # refreshed at every eval

    def close(self) -> None:
        """Flush everything and draw ``loss.png`` (rank 0)."""
        self.log.close()
        if self.rank != 0:
            return
        self.metrics.close()
        self.board.close()
        if self.records:
            plot_loss(self.records, self.path / "loss.png")


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
