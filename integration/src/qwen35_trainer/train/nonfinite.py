"""What the loop does with a step whose loss or gradient norm is not finite.

:func:`qwen35_trainer.train.step.train_step` checks the global loss and the global gradient norm
(the one computed for clipping, the same number on every rank) BEFORE the optimizer step and
does not apply a non-finite step: no parameter and no optimizer state changes. Since both
numbers are global, every rank takes the same decision without another collective; only the
documents' sources are gathered (one collective, on this rare path), so the message can name
the whole global batch.

``train.on_nonfinite``:

- ``stop`` (default): :class:`NonFiniteStep` is raised after the step is logged — the weights
  are those after the previous step, the newest checkpoint is untouched — naming the step and
  the documents of its global batch (``file:row``); ``qwen35-train`` exits 1;
- ``skip``: the step's update is dropped (gradients zeroed, optimizer state untouched; the
  learning-rate schedule goes on), a WARNING names the step and its documents, and the run
  goes on; ``skipped_steps`` counts them in ``metrics.jsonl``; after
  ``train.max_skipped_steps`` skipped steps in a row the run stops as under ``stop``.
"""

from __future__ import annotations

import logging

from qwen35_trainer.parallel.dist import all_ranks

__all__ = ["NonFiniteGuard", "NonFiniteStep", "global_sources"]

logger = logging.getLogger("qwen35_trainer")

_SHOWN = 20  # documents named in a message


class NonFiniteStep(FloatingPointError):
    """Step ``step`` had a non-finite loss or gradient norm and was not applied; ``sources``:
    the documents of its global batch; ``result``: the run so far, set by
    :func:`qwen35_trainer.train` (its logs, and the model and optimizer as after the last
    applied step)."""

    result = None

    def __init__(
        self, step: int, loss: float, grad_norm: float, sources: list[str], why: str = ""
    ) -> None:
        self.step, self.sources = step, sources
        shown = ", ".join(sources[:_SHOWN]) + (
            f", ... ({len(sources)} in all)" if len(sources) > _SHOWN else ""
        )
        super().__init__(
            f"step {step}: loss {loss}, gradient norm {grad_norm}; the update was not applied"
            f"{why}. Documents of the step's global batch: {shown}"
        )


def global_sources(sources: tuple[str, ...]) -> list[str]:
    """Every rank's document sources, in rank order, each once (CP / TP peers share rows)."""
    return list(dict.fromkeys(s for rank in all_ranks(sources) for s in rank))


class NonFiniteGuard:
    """Applies ``train.on_nonfinite`` after each step; ``skipped``: steps skipped so far."""

    def __init__(self, policy: str, max_in_a_row: int) -> None:
        self.policy, self.max_in_a_row = policy, max_in_a_row
        self.skipped = self._in_a_row = 0

    def check(
        self, step: int, loss: float, result, sources: tuple[str, ...]
    ) -> NonFiniteStep | None:
        """After step ``step`` (1-based) with the logged ``loss`` and the
        :class:`~qwen35_trainer.train.step.StepResult` ``result``: ``None`` when it was applied or is
        skipped, else the error the loop raises once the step is logged (every rank calls
        this, and all get the same answer)."""
        if result.applied:
            self._in_a_row = 0
            return None
        error = NonFiniteStep(step, loss, result.grad_norm, global_sources(sources))
        if self.policy == "stop":
            return error
        self.skipped += 1
        self._in_a_row += 1
        if self._in_a_row >= self.max_in_a_row:
            return NonFiniteStep(
                step,
                loss,
                result.grad_norm,
                error.sources,
                f" (train.max_skipped_steps={self.max_in_a_row} skipped in a row)",
            )
        logger.warning("skipped: %s", error)
        return None
