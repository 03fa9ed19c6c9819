"""``qwen35-train RECIPE [--set section.key=value ...] [--nproc N]``: train a recipe;
``qwen35-train plan RECIPE [--world-size N] [--gpu-memory GiB] [--json FILE]``: will it fit?
``qwen35-train export RECIPE CHECKPOINT OUT``: a training checkpoint as a transformers directory;
``qwen35-train data make-demo DIR`` / ``qwen35-train data check RECIPE``: the demo dataset, and
a report of a recipe's dataset read through its processor;
``qwen35-train checkpoint verify DIR``: is a checkpoint (or each one under DIR) intact?
``qwen35-train replay RECIPE CHECKPOINT --step N``: step N recomputed from the checkpoint before
it, with every layer's gradient norm and the documents of its batch.

``RECIPE`` is a YAML file or the name of a built-in recipe (``tiny``). A recipe that needs N
ranks, run outside torchrun, starts its N local workers itself through PyTorch's elastic
launcher (gloo on CPU, NCCL on GPUs); under ``torchrun`` or Slurm (``WORLD_SIZE`` set) it just
runs. ``--nproc N`` sets the number of workers, the data-parallel degree following from it.

Outputs go to the run folder ``train.output_dir`` (default ``runs/<recipe>-<time>``):
``recipe.yaml``, ``metrics.jsonl``, TensorBoard events, ``loss.png``, per-rank logs, and the
checkpoints / export when the recipe asks for them. Rank 0 prints one line per step (a
progress bar on a terminal) and every message; the other ranks print nothing.

Exit status: 0 the run finished; 1 a step with a non-finite loss or gradient norm, not applied
(``train.on_nonfinite: stop``, or too many skipped in a row; the message names the step and the
documents of its global batch); 2 a bad recipe, one that does not fit the launch or the model, or a bad data row (the
message says why, naming the file and row);
3 (``checkpoint verify``) a checkpoint that is not intact;
4 an unexpected internal error (with its traceback); 5 stopped by SIGTERM / SIGUSR1 after
finishing a step and saving a checkpoint (run the same command again to resume).
``--max-restarts N`` (with the built-in launch) brings all workers back after a worker dies,
each resuming from the newest complete checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
import uuid
from pathlib import Path

import torch.distributed as dist

from qwen35_trainer.preemption import Preempted
from qwen35_trainer.recipe import (
    add_recipe_arguments,
    builtin_recipes,
    load_recipe,
    recipe_path,
)
from qwen35_trainer.train import StepLog, train

__all__ = [
    "EXIT_BAD_RECIPE",
    "EXIT_INTERNAL",
    "EXIT_NON_FINITE",
    "EXIT_NOT_INTACT",
    "EXIT_PREEMPTED",
    "main",
]

EXIT_NON_FINITE, EXIT_BAD_RECIPE, EXIT_NOT_INTACT, EXIT_INTERNAL, EXIT_PREEMPTED = 1, 2, 3, 4, 5


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen35-train",
        description=__doc__.split("\n\n")[0],
        epilog="Subcommands: qwen35-train plan RECIPE (memory / communication per GPU on a fake "
        "world, exit 3 when it does not fit); qwen35-train export RECIPE CHECKPOINT OUT (a "
        "training checkpoint as a transformers directory); qwen35-train data make-demo DIR | check "
        "RECIPE (write the demo dataset; read a recipe's dataset and report it); qwen35-train "
        "checkpoint verify DIR (each checkpoint intact, damaged or incomplete; exit 3 unless all "
        "are intact); qwen35-train replay RECIPE CHECKPOINT --step N (recompute one step: "
        "per-layer gradient norms, its documents). Outputs: runs/<recipe>-<time>/ "
        "(recipe.yaml, metrics.jsonl, tensorboard/, loss.png, logs/). Built-in recipes: "
        + ", ".join(builtin_recipes()),
    )
    add_recipe_arguments(parser)
    parser.add_argument(
        "--nproc", type=int, help="local workers to start (default: what the recipe needs)"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all local workers up to N times after one fails (each resumes from the "
        "newest checkpoint)",
    )

    return parser


def _eta(log: StepLog, steps: int, first: tuple[int, float] | None) -> str:
    """Remaining time at the pace since the first reported step (which includes the warmup of
    the first step: compiles, allocations); "--" until there is a pace."""
    if first is None or log.step == first[0]:
        return "--"
    left = (time.perf_counter() - first[1]) / (log.step - first[0]) * (steps - log.step)
    return f"{int(left // 60)}:{int(left % 60):02d}"


def _line(log: StepLog, steps: int, eta: str) -> str:
    rate = log.tokens / log.seconds if log.seconds > 0 else float("nan")
    return (
        f"step {log.step:>{len(str(steps))}}/{steps}  loss {log.loss:.4f}  ce {log.ce:.4f}  "
        f"aux {log.aux:.4f}  grad_norm {log.grad_norm:.3f}  lr {log.lr:.3g}  "
        f"tokens {log.tokens}  {rate:.0f} tok/s  {log.seconds * 1000:.0f} ms  eta {eta}"
        + ("" if log.fill is None else f"  fill {log.fill:.2f}")
        + _eval_part(log)
    )


def _eval_part(log: StepLog) -> str:
    if log.eval_loss is None:
        return ""
    return f"  eval {log.eval_loss:.4f}  accuracy {log.eval_accuracy:.3f}"


def _output_dir(recipe_arg: str) -> str:
    """``runs/<recipe>-<time>``; under a launcher the run id, the same on every rank."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    stamp = run_id if run_id and run_id != "none" else time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{recipe_path(recipe_arg).stem}-{stamp}")


def _world(parallel) -> int:
    return parallel.dp_replicate * parallel.dp * parallel.cp * parallel.tp


def _launch(argv: list[str], nproc: int, max_restarts: int) -> int:
    """Start ``nproc`` local workers running this command (they see ``WORLD_SIZE``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the workers say why they stop (rank 0's message); the process supervisor's own lines
    # ("failed (exitcode: N)", "Sending process ... closing signal") only repeat it. Restart
    # notices come from the agent's logger and stay.
    logging.getLogger("torch.distributed.elastic.multiprocessing").setLevel(logging.CRITICAL)
    # like torchrun: the workers share the cores (unset, each would take all of them; 4 workers
    # x 2 threads on 2 cores wait on each other at every parallel region)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                          max_restarts=max_restarts)  # fmt: skip
    try:
        elastic_launch(config, sys.executable)("-m", "qwen35_trainer.cli", *argv)
    except ChildFailedError as failed:  # the first worker to fail says why (others follow)
        rank, failure = failed.get_first_failure()
        if failure.exitcode < 0:  # killed by a signal: nobody else says so
            print(f"qwen35-train: worker rank {rank} was killed by signal {-failure.exitcode}",
                  file=sys.stderr, flush=True)  # fmt: skip
            return 128 - failure.exitcode  # the shell's convention
        return failure.exitcode
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command; a worker of a multi-rank run leaves through :func:`_worker_exit`."""
    code = _main(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_initialized():
        _worker_exit(code)
    return code


def _worker_exit(code: int) -> None:
    """End a worker without the interpreter's teardown. There, gloo's threads abort the process
    now and then ("terminate called without an active exception", exit 134): a finished run
    reads as failed, and the launcher then kills the ranks still writing their outputs (rank 0's
    ``loss.png``, rank 0's last message). After a successful or an agreed preempted run every
    rank waits for the others (they all ran the same collectives and stopped after the same
    step, so none waits forever), the group is destroyed, and the process exits with ``code``."""
    if code in (0, EXIT_PREEMPTED):
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _checkpoint_main(argv: list[str]) -> int:
    """``qwen35-train checkpoint verify DIR``: one line per checkpoint (intact / damaged and
    why / incomplete / no manifest); exit 0 when every one is intact, 3 otherwise, 2 when DIR
    holds no checkpoint."""
    parser = argparse.ArgumentParser(
        prog="qwen35-train checkpoint",
        description="Check checkpoints against their manifests (file sizes and checksums).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("verify", help="verify one checkpoint or every one under DIR")
    check.add_argument("dir", type=Path, help="a step_NNNNNN directory, or a directory of them")
    check.add_argument("--sizes-only", action="store_true", help="compare sizes, not checksums")
    args = parser.parse_args(argv)
    from qwen35_trainer.integrity import INTACT, verify_all

    try:
        verdicts = verify_all(args.dir, checksums=not args.sizes_only)
    except ValueError as err:
        print(f"qwen35-train checkpoint: {err}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    for verdict in verdicts:
        size = f" ({verdict.files} files, {verdict.size / 2**20:.1f} MiB)" if verdict.files else ""
        print(f"{verdict.path.name}: {verdict.describe()}{size}")
    return 0 if all(v.state == INTACT for v in verdicts) else EXIT_NOT_INTACT


def _replay_main(argv: list[str]) -> int:
    """``qwen35-train replay RECIPE CHECKPOINT --step N``: step N recomputed from the checkpoint
    before it, on the recipe's launch (its workers started here when needed); exit 0, or 2
    with the reason."""
    parser = argparse.ArgumentParser(
        prog="qwen35-train replay",
        description="Recompute one training step from the checkpoint before it: its loss and "
        "gradient norm (compared with the run's metrics.jsonl), every layer's gradient norm "
        "before clipping, and the documents of its global batch.",
    )
    add_recipe_arguments(parser, recipe_help="the recipe the run was trained with")
    parser.add_argument("checkpoint", type=Path, help="a step_NNNNNN directory or its parent")
    parser.add_argument("--step", type=int, required=True, help="the step to recompute (1-based)")
    args = parser.parse_args(argv)
    printing = os.environ.get("RANK", "0") == "0"
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        if "WORLD_SIZE" not in os.environ and _world(recipe.parallel) > 1:
            return _launch(["replay", *argv], _world(recipe.parallel), 0)
        from qwen35_trainer.replay import logged_record, replay

        result = replay(recipe, args.checkpoint, args.step)
    except (OSError, ValueError) as err:
        if printing:
            print(f"qwen35-train replay: {err}", file=sys.stderr, flush=True)
        return EXIT_BAD_RECIPE
    if printing:
        print(result.report(logged_record(result.checkpoint, args.step)), flush=True)
    return 0


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        from qwen35_trainer.plan.command import plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["export"]:
        from qwen35_trainer.export_command import export_main

        return export_main(argv[1:])
    if argv[:1] == ["data"]:
        from qwen35_trainer.data.command import data_main

        return data_main(argv[1:])
    if argv[:1] == ["checkpoint"]:
        return _checkpoint_main(argv[1:])
    if argv[:1] == ["replay"]:
        return _replay_main(argv[1:])
    args = _parser().parse_args(argv)
    printing = os.environ.get("RANK", "0") == "0"

    def say(message: str) -> None:
        if printing:
            print(f"qwen35-train: {message}", file=sys.stderr, flush=True)

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        extra = []
        if args.nproc is not None:
            p = recipe.parallel
            per_dp = p.dp_replicate * p.cp * p.tp
            if args.nproc < 1 or args.nproc % per_dp:
                raise ValueError(
                    f"--nproc {args.nproc} is not a multiple of parallel.dp_replicate x cp x tp "
                    f"= {per_dp}, so no data-parallel degree fits it"
                )
            extra.append(f"parallel.dp={args.nproc // per_dp}")
        if recipe.train.output_dir is None:
            extra.append(f"train.output_dir={_output_dir(args.recipe)}")
        recipe = load_recipe(args.recipe, [*args.overrides, *extra])
    except (OSError, ValueError) as err:
        say(f"bad recipe: {err}")
        return EXIT_BAD_RECIPE
    if "WORLD_SIZE" not in os.environ and _world(recipe.parallel) > 1:
        sets = [a for item in [*args.overrides, *extra] for a in ("--set", item)]
        return _launch([args.recipe, *sets], _world(recipe.parallel), args.max_restarts)
    if printing:
        logging.basicConfig(level=logging.INFO, format="qwen35-train: %(message)s")
    steps, first = recipe.train.steps, [None]
    bar = None
    if printing and sys.stdout.isatty():  # a terminal: one progress bar instead of lines
        from tqdm import tqdm

        bar = tqdm(total=steps, unit="step", dynamic_ncols=True)

    def report(log: StepLog) -> None:
        first[0] = first[0] or (log.step, time.perf_counter())
        if bar is not None:
            bar.n = log.step
            rate = log.tokens / log.seconds if log.seconds > 0 else 0.0
            bar.set_postfix(loss=f"{log.loss:.4f}", lr=f"{log.lr:.2g}", tok_s=f"{rate:.0f}")
        elif printing and (log.step % recipe.train.log_every == 0 or log.step == steps):
            print(_line(log, steps, _eta(log, steps, first[0])), flush=True)

    try:
        logs = train(recipe, on_step=report).logs
        if bar is not None:
            bar.close()
    except FloatingPointError as err:
        say(str(err))
        return EXIT_NON_FINITE
    except Preempted as stopped:
        say(f"{stopped}; run the same command again to resume")
        return EXIT_PREEMPTED
    except ValueError as err:  # a recipe that does not fit the launch or the model
        say(str(err))
        return EXIT_BAD_RECIPE
    except Exception:
        say("internal error (please report it):\n" + traceback.format_exc())
        return EXIT_INTERNAL
    if printing and logs:
        print(f"done: steps {logs[0].step}..{logs[-1].step} of {steps}, "
              f"loss {logs[0].loss:.4f} -> {logs[-1].loss:.4f}; run folder "
              f"{recipe.train.output_dir}")  # fmt: skip
    elif printing:
        print(f"done: nothing to run, the newest checkpoint already has {steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
