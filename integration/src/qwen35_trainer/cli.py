"""``qwen35-train RECIPE [--set section.key=value ...] [--nproc N]``: train a recipe;
``qwen35-train plan RECIPE [--world-size N] [--gpu h100|h200|b200] [--json FILE] [--search]``:
will it fit, and how long a step takes (``--search``: which layout)?
``qwen35-train export RECIPE CHECKPOINT OUT``: a training checkpoint as a transformers directory;
``qwen35-train data make-demo DIR`` / ``qwen35-train data check RECIPE``: the demo dataset, and
a report of a recipe's dataset read through its processor;
``qwen35-train checkpoint verify DIR``: is a checkpoint (or each one under DIR) intact?
``qwen35-train replay RECIPE CHECKPOINT --step N``: step N recomputed from the checkpoint before
it, with every layer's gradient norm and the documents of its batch.
``qwen35-train show RECIPE [--set ...]``: the resolved recipe, byte for byte the run folder's
``recipe.yaml`` of the same command (:mod:`qwen35_trainer.cli_info`); ``qwen35-train
--version``: the versions of the trainer, its packages, torch and transformers.

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
finishing a step and saving a checkpoint (run the same command again to resume); 6 a rank made
no progress for ``train.hang_timeout`` seconds (stacks in ``<output_dir>/hang/``).
``--max-restarts N`` (with the built-in launch) brings all workers back after a worker dies,
each resuming from the newest complete checkpoint; the launcher says which worker died how and
each restart.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from qwen35_trainer.cli_common import (
    EXIT_BAD_RECIPE,
    EXIT_BAD_ROWS,
    EXIT_INTERNAL,
    EXIT_NON_FINITE,
    EXIT_NOT_INTACT,
    EXIT_PREEMPTED,
    add_recipe_arguments,
)
from qwen35_trainer.cli_info import VersionAction, run_recipe, show_main
from qwen35_trainer.recipe import (
    builtin_recipes,
    load_recipe,
)
from qwen35_trainer.recipe.dimensions import product
from qwen35_trainer.supervise.console import Console, quiet_cpu_notices
from qwen35_trainer.supervise.launch import Watched, launch, worker_exit
from qwen35_trainer.supervise.preemption import Preempted, catch_stop_signals
from qwen35_trainer.train import train
from qwen35_trainer.train.export import check_export_dir
from qwen35_trainer.train.loop import check_run
from qwen35_trainer.train.resume import newest_checkpoint

__all__ = [
    "EXIT_BAD_RECIPE",
    "EXIT_INTERNAL",
    "EXIT_NON_FINITE",
    "EXIT_NOT_INTACT",
    "EXIT_PREEMPTED",
    "main",
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen35-train",
        description=__doc__.split("\n\n")[0],
        epilog="Subcommands: qwen35-train plan RECIPE (memory / communication per GPU on a fake "
        "world and the step's time on --gpu, exit 3 when it does not fit); qwen35-train export RECIPE CHECKPOINT OUT (a "
        "training checkpoint as a transformers directory); qwen35-train data make-demo DIR | check "
        "RECIPE (write the demo dataset; read a recipe's dataset and report it); qwen35-train "
        "checkpoint verify DIR (each checkpoint intact, damaged or incomplete; exit 3 unless all "
        "are intact); qwen35-train replay RECIPE CHECKPOINT --step N (recompute one step: "
        "per-layer gradient norms, its documents); qwen35-train show RECIPE (the resolved "
        "recipe, as the run folder's recipe.yaml). Outputs: runs/<recipe>-<time>/ "
        "(recipe.yaml, metrics.jsonl, tensorboard/, loss.png, logs/). Built-in recipes: "
        + ", ".join(builtin_recipes()),
    )
    add_recipe_arguments(parser)
    parser.add_argument("--version", action=VersionAction)
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


def main(argv: list[str] | None = None) -> int:
    """The command; a worker of a multi-rank run leaves through :func:`~qwen35_trainer.supervise.launch.worker_exit`
    (only a member of a multi-rank group: a process holding a one-rank group, as one process's
    training leaves it, gets the code back, even with ``WORLD_SIZE`` set)."""
    quiet_cpu_notices()
    code = _main(argv)
    if (
        int(os.environ.get("WORLD_SIZE", "1")) > 1
        and dist.is_initialized()
        and dist.get_world_size() > 1
    ):
        worker_exit(code, agreed=code in (0, EXIT_PREEMPTED))
    return code


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
    from qwen35_trainer.train.integrity import INTACT, verify_all

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
        if "WORLD_SIZE" not in os.environ and recipe.parallel.world > 1:
            return launch(["replay", *argv], recipe.parallel.world, 0)
        from qwen35_trainer.train.replay import logged_record, replay

        result = replay(recipe, args.checkpoint, args.step)
    except (OSError, ValueError) as err:
        if printing:
            print(f"qwen35-train replay: {err}", file=sys.stderr, flush=True)
        return EXIT_BAD_RECIPE
    if printing:
        print(result.report(logged_record(result.checkpoint, args.step)), flush=True)
    return 0


def _plan_main(argv: list[str]) -> int:
    """``qwen35-train plan`` (:mod:`qwen35_trainer.plan.command`)."""
    from qwen35_trainer.plan.command import plan_main

    return plan_main(argv)


def _export_main(argv: list[str]) -> int:
    """``qwen35-train export RECIPE CHECKPOINT OUT [--overwrite] [--experts L] [--dtype D]``
    (:mod:`qwen35_trainer.train.export`); exit 0, or 2 with the reason (bad recipe, no
    checkpoint there, a damaged checkpoint, one of another model, a folder that is not
    empty)."""
    from qwen35_trainer.model.lora.peft_export import LORA_FORMATS
    from qwen35_trainer.train.export import DTYPES, EXPERT_LAYOUTS

    parser = argparse.ArgumentParser(
        prog="qwen35-train export",
        description="A training checkpoint as a transformers checkpoint folder: the weights in "
        "the source checkpoint's expert layout and dtype, config.json, and the source's "
        "processor, tokenizer, chat template and generation config.",
    )
    add_recipe_arguments(parser, recipe_help="the recipe the checkpoint was trained with")
    parser.add_argument("checkpoint", type=Path, help="a step_NNNNNN directory or its parent")
    parser.add_argument("out", type=Path, help="the folder to write (new or empty)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a folder that is not empty, removing the weights it holds first",
    )
    parser.add_argument(
        "--experts",
        choices=EXPERT_LAYOUTS,
        default="source",
        help="the routed experts' layout (default: the source checkpoint's, stacked without one)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help="the weights' dtype (default: the source checkpoint's; fp8: the projections Qwen's "
        "FP8 releases convert in block-scaled FP8, with their quantization_config)",
    )
    parser.add_argument(
        "--lora",
        choices=LORA_FORMATS,
        help="a LoRA run's export: peft (default: PEFT's adapter folder, the experts in its "
        "target_parameters layout), per_expert (2-D adapters per expert) or merged (the "
        "merged weights as a checkpoint folder)",
    )
    parser.add_argument("--base", help="the base an adapter export names (default: model.path)")
    args = parser.parse_args(argv)
    from qwen35_trainer.train.export import ExportOptions, export_checkpoint, resolve_checkpoint

    logging.basicConfig(level=logging.WARNING, format="qwen35-train export: %(message)s")
    options = ExportOptions(args.overwrite, args.experts, args.dtype, args.lora, args.base)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        checkpoint = resolve_checkpoint(args.checkpoint)
        step, notes = export_checkpoint(recipe, checkpoint, args.out, options)
    except (OSError, ValueError) as err:
        print(f"qwen35-train export: {err}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    if os.environ.get("RANK", "0") == "0":
        print(f"exported step {step} of {checkpoint} to {args.out}")
        for note in notes:
            print(f"  {note}")
    return 0


def _data_main(argv: list[str]) -> int:
    """``qwen35-train data make-demo DIR`` (:mod:`qwen35_trainer.demo.dataset`) and ``data check
    RECIPE [--limit N]`` (:mod:`qwen35_trainer.data.check`); exit 0, 3 when rows are bad
    (listed), 2 for a bad recipe or dataset."""
    parser = argparse.ArgumentParser(
        prog="qwen35-train data", description="The demo dataset, and a recipe's dataset checked."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-demo", help="write the demo dataset into DIR")
    make.add_argument("dir", type=Path)
    make.add_argument("--train-rows", type=int, default=800)
    make.add_argument("--heldout-rows", type=int, default=128)
    check = sub.add_parser("check", help="read a recipe's dataset and report it")
    add_recipe_arguments(check)
    check.add_argument("--limit", type=int, help="read only the first N rows")
    args = parser.parse_args(argv)
    if args.command == "make-demo":
        from qwen35_trainer.demo.dataset import make_demo

        root = make_demo(args.dir, train_rows=args.train_rows, heldout_rows=args.heldout_rows)
        print(
            f"wrote the demo dataset to {root}: train.jsonl ({args.train_rows} rows), "
            f"heldout.jsonl ({args.heldout_rows} rows), images/, videos/, processor/"
        )
        return 0
    from qwen35_trainer.data.check import check_dataset
    from qwen35_trainer.model import build_config

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        report = check_dataset(recipe, build_config(recipe.model), args.limit)
    except (OSError, ValueError) as error:
        print(f"qwen35-train data: {error}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    print("\n".join(report.lines()))
    return EXIT_BAD_ROWS if report.bad_rows else 0


SUBCOMMANDS = {
    "plan": _plan_main,
    "export": _export_main,
    "data": _data_main,
    "checkpoint": _checkpoint_main,
    "replay": _replay_main,
    "show": show_main,
}


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    args = _parser().parse_args(argv)
    printing = os.environ.get("RANK", "0") == "0"

    def say(message: str) -> None:
        if printing:
            print(f"qwen35-train: {message}", file=sys.stderr, flush=True)

    try:
        recipe, extra = run_recipe(args.recipe, args.overrides, args.nproc)
    except (OSError, ValueError) as err:
        say(f"bad recipe: {err}")
        return EXIT_BAD_RECIPE
    if "WORLD_SIZE" not in os.environ and recipe.parallel.world > 1:
        try:  # refused here, in one process, before any worker starts
            check_run(recipe, recipe.parallel.world)
            if recipe.train.export_dir:
                check_export_dir(recipe.train.export_dir, recipe.train.export_overwrite)
        except ValueError as err:
            say(str(err))
            return EXIT_BAD_RECIPE
        sets = [a for item in [*args.overrides, *extra] for a in ("--set", item)]
        say(f"starting {recipe.parallel.world} local workers: {_world_product(recipe.parallel)}")
        training = recipe.train
        watched = Watched(
            training.output_dir,
            functools.partial(newest_checkpoint, training.checkpoint_root),
            training.stop_timeout,
        )
        return launch([args.recipe, *sets], recipe.parallel.world, args.max_restarts, watched)
    catch_stop_signals()  # a worker: a stop signal from now on is kept for the run
    if printing:
        logging.basicConfig(level=logging.INFO, format="qwen35-train: %(message)s")
    console = Console(recipe.train.steps, recipe.train.log_every, printing)
    try:
        with train(recipe, on_step=console.step) as result:
            logs = result.logs
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
    console.close(logs, recipe.train.output_dir)
    return 0


def _world_product(p) -> str:
    """How the recipe's degrees make its worker count (``--nproc N`` changes dp)."""
    return f"{product(p, ones=False)} (--nproc N changes dp)"


if __name__ == "__main__":
    sys.exit(main())
