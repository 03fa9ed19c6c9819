"""``qwen35-train RECIPE [--set section.key=value ...]``: run a recipe, print one line per step.

One process by default; under ``torchrun --nproc-per-node N`` (with ``parallel.dp=N``) every
rank trains its share and rank 0 prints. Exit status 0 when every step ran and the loss stayed
finite, 1 otherwise (the message says which step went wrong), 2 for a bad recipe or one that
does not fit the launch (the message says why).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from qwen35_trainer.recipe import load_recipe
from qwen35_trainer.train import StepLog, train

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen35-train", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="path of a YAML recipe, e.g. recipes/tiny.yaml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one recipe value (repeatable), e.g. --set train.steps=5",
    )
    return parser


def _line(log: StepLog, steps: int) -> str:
    return (
        f"step {log.step:>{len(str(steps))}}/{steps}  loss {log.loss:.4f}  ce {log.ce:.4f}  "
        f"aux {log.aux:.4f}  grad_norm {log.grad_norm:.3f}  tokens {log.tokens}  "
        f"{log.seconds * 1000:.0f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except (OSError, ValueError) as err:
        print(f"qwen35-train: bad recipe: {err}", file=sys.stderr)
        return 2
    printing = os.environ.get("RANK", "0") == "0"
    steps = recipe.train.steps

    def report(log: StepLog) -> None:
        if not math.isfinite(log.loss):
            raise FloatingPointError(f"step {log.step}: loss is {log.loss}")
        if printing and (log.step % recipe.train.log_every == 0 or log.step == steps):
            print(_line(log, steps), flush=True)

    try:
        logs = train(recipe, on_step=report).logs
    except FloatingPointError as err:
        print(f"qwen35-train: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # a recipe that does not fit the launch or the model
        print(f"qwen35-train: {err}", file=sys.stderr)
        return 2
    if printing and logs:
        print(f"done: steps {logs[0].step}..{logs[-1].step} of {steps}, "
              f"loss {logs[0].loss:.4f} -> {logs[-1].loss:.4f}")  # fmt: skip
    elif printing:
        print(f"done: nothing to run, the newest checkpoint already has {steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
