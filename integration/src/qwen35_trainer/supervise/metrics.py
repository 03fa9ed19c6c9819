"""One optimizer step's record: :class:`StepLog` (what the step did, global numbers) and its
``metrics.jsonl`` form, whose keys are :data:`METRIC_FIELDS` — derived from the record itself,
so the console, the run folder, TensorBoard and the tests read one list.
"""

from __future__ import annotations

import dataclasses
import math
import resource

import torch

__all__ = ["METRIC_FIELDS", "StepLog", "peak_memory_mib"]


@dataclasses.dataclass(frozen=True)
class StepLog:
    """What one optimizer step did (global numbers, equal on every rank). ``seconds``: the
    step's wall time, ``data_seconds`` of it spent building its batches; ``peak_memory_mib``:
    this rank's peak so far (CUDA allocator, or RSS on CPU); the expert load is over every
    layer's routed assignments of the step's row tokens (padding included); ``mfu``: the step's
    model FLOPs (:mod:`qwen35_trainer.model.flops`) over its time and every rank's peak FLOP/s
    (``None`` where the peak is unknown, e.g. on CPU); ``eval_accuracy``: the held-out labels'
    next-token accuracy; with a dataset (:mod:`qwen35_trainer.data.loader`): ``data_seconds``
    is the time the step waited for its rows, ``fill`` the share of the rows' capacity holding
    document tokens, ``over_capacity`` the documents longer than ``data.pack_length``
    (truncated or dropped) and ``bad_rows`` the rows skipped under ``data.on_bad_row: skip``,
    both in this step; ``skipped_steps``: the steps of this run not applied so far
    (non-finite, ``train.on_nonfinite: skip``; :mod:`qwen35_trainer.train.nonfinite`);
    with the multi-token-prediction head (:mod:`qwen35_trainer.model.mtp`): ``mtp_loss``, each
    depth's cross-entropy (``loss`` includes ``train.mtp_loss_weight`` times their mean), and
    ``eval_mtp_accuracy``, the held-out top-1 accuracy of depth 1 on token ``t + 2``."""

    step: int
    loss: float
    ce: float
    aux: float
    grad_norm: float
    tokens: int
    seconds: float
    lr: float = 0.0
    eval_loss: float | None = None
    data_seconds: float = 0.0
    peak_memory_mib: float = 0.0
    expert_load_max_over_mean: float = 1.0
    experts_idle: int = 0
    cp_imbalance: float = 1.0
    mfu: float | None = None
    eval_accuracy: float | None = None
    fill: float | None = None
    over_capacity: int = 0
    bad_rows: int = 0
    skipped_steps: int = 0
    mtp_loss: tuple[float, ...] | None = None
    eval_mtp_accuracy: float | None = None

    def metrics(self) -> dict:
        """The ``metrics.jsonl`` record (:data:`METRIC_FIELDS` but ``attempt``, which the run
        folder adds); a non-finite number is ``null`` (JSON has none)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["step_seconds"] = out.pop("seconds")
        out["tokens_per_s"] = self.tokens / self.seconds if self.seconds > 0 else None
        if self.mtp_loss is not None:
            out["mtp_loss"] = [_finite(v) for v in self.mtp_loss]
        return {k: _finite(v) for k, v in out.items()}


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


# Every metrics.jsonl record has exactly these keys: StepLog's fields (``seconds`` written as
# ``step_seconds``), the derived ``tokens_per_s`` and the run folder's ``attempt`` (which start
# of the run folder took the step, :mod:`qwen35_trainer.supervise.run_folder`).
METRIC_FIELDS = (
    *("step_seconds" if f.name == "seconds" else f.name for f in dataclasses.fields(StepLog)),
    "tokens_per_s",
    "attempt",
)


def peak_memory_mib(device: torch.device) -> float:
    """The CUDA allocator's peak on GPU; this process's peak RSS on CPU (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
