"""What a ``qwen35-train`` command runs, said without running it: ``qwen35-train --version``
(the installed versions) and ``qwen35-train show RECIPE [--set ...] [--nproc N]`` (the resolved
recipe).

``show`` prints the file a run of the same command writes as its run folder's ``recipe.yaml``,
byte for byte, because both come from the same two functions: :func:`run_recipe` (the recipe
as the training command resolves it, the command's own defaults included — ``--nproc``'s
``parallel.dp`` and the run folder ``train.output_dir`` when the recipe names none, ``runs/
<recipe>-<time>`` as of now, or the launcher's run id under one) and
:func:`~qwen35_trainer.supervise.run_folder.recipe_yaml` (the YAML with every default filled in,
under the comments that name the kernel each layer kind runs on this machine:
:func:`~qwen35_trainer.model.kernels.resolve_kernels`, which reads the recipe and the installed
packages only). It starts nothing: no process group, no worker, no model; a recipe it cannot
resolve (or a named kernel that cannot run here) exits 2 with the reason, as the run would.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

import torch

from qwen35_trainer.cli_common import EXIT_BAD_RECIPE, add_recipe_arguments

__all__ = ["PACKAGES", "VersionAction", "run_recipe", "show_main", "versions"]

# the trainer, the workspace packages it runs on (dist-testkit is for tests only), and the two
# libraries whose versions decide what runs
PACKAGES = (
    "qwen35-trainer",
    "moe-parallel",
    "cp-vision",
    "cp-varlen-attn",
    "chunked-loss",
    "fsdp-compat",
    "safe-optim",
    "setup-prewarm",
    "async-tp-linear",
    "torch",
    "transformers",
)


def versions() -> list[str]:
    """``NAME VERSION`` per :data:`PACKAGES` entry, as the installed distribution's metadata
    says (``not installed`` when it is missing)."""
    lines = []
    for name in PACKAGES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        lines.append(f"{name} {version}")
    return lines


class VersionAction(argparse.Action):
    """``--version``: print :func:`versions` and exit 0 (the metadata is read only when the
    flag is given)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        kwargs.setdefault("help", "print the versions of the trainer, its packages, torch and "
                          "transformers, and exit")  # fmt: skip
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print("\n".join(versions()))
        parser.exit(0)


def run_recipe(recipe_arg: str, overrides: list[str], nproc: int | None):
    """The recipe the training command runs, and the overrides it adds to the user's
    (``--nproc``'s ``parallel.dp``; ``train.output_dir`` when the recipe names none);
    ``ValueError`` / ``OSError`` for a recipe that cannot be read."""
    from qwen35_trainer.recipe import load_recipe
    from qwen35_trainer.supervise.launch import default_output_dir

    recipe = load_recipe(recipe_arg, overrides)
    extra = []
    if nproc is not None:
        extra.append(f"parallel.dp={recipe.parallel.filling(nproc, '--nproc').dp}")
    if recipe.train.output_dir is None:
        extra.append(f"train.output_dir={default_output_dir(recipe_arg)}")
    return load_recipe(recipe_arg, [*overrides, *extra]), extra


def show_main(argv: list[str]) -> int:
    """``qwen35-train show RECIPE [--set ...] [--nproc N]`` (module docstring); exit 0, or 2
    with the reason."""
    from qwen35_trainer.model.kernels import resolve_kernels
    from qwen35_trainer.supervise.run_folder import recipe_yaml

    parser = argparse.ArgumentParser(
        prog="qwen35-train show",
        description="Print the resolved recipe exactly as a run of the same command writes it "
        "into its run folder (recipe.yaml), the command's defaults included (train.output_dir "
        "runs/<recipe>-<time> when the recipe names none); nothing is started.",
    )
    add_recipe_arguments(parser)
    parser.add_argument("--nproc", type=int, help="as the training command's --nproc")
    args = parser.parse_args(argv)
    try:
        recipe, _ = run_recipe(args.recipe, args.overrides, args.nproc)
        kernels = resolve_kernels(recipe, "cuda" if torch.cuda.is_available() else "cpu")
    except (OSError, ValueError) as err:
        print(f"qwen35-train show: {err}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    sys.stdout.write(recipe_yaml(recipe, kernels.record()))
    sys.stdout.flush()
    return 0
