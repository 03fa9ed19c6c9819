"""What every ``qwen35-train`` subcommand shares: the exit-code table and the recipe
arguments."""

from __future__ import annotations

__all__ = [
    "EXIT_BAD_RECIPE",
    "EXIT_BAD_ROWS",
    "EXIT_DOES_NOT_FIT",
    "EXIT_HUNG",
    "EXIT_INTERNAL",
    "EXIT_NON_FINITE",
    "EXIT_NOT_INTACT",
    "EXIT_PREEMPTED",
    "add_recipe_arguments",
]

# The one exit-code table of every qwen35-train command.
EXIT_NON_FINITE = 1  # a step with a non-finite loss or gradient norm (not applied)
EXIT_BAD_RECIPE = 2  # bad input: recipe, launch, data row, checkpoint path (one message says why)
EXIT_NOT_INTACT = 3  # a finding: checkpoint not intact, bad data rows, a plan that does not fit
EXIT_BAD_ROWS = EXIT_DOES_NOT_FIT = EXIT_NOT_INTACT
EXIT_INTERNAL = 4  # an unexpected internal error (with its traceback)
EXIT_PREEMPTED = 5  # stopped by SIGTERM / SIGUSR1 after a step and a checkpoint
EXIT_HUNG = 6  # a rank made no progress for train.hang_timeout (stacks in <output_dir>/hang/)


def add_recipe_arguments(
    parser, *, recipe_help: str = "a YAML recipe file, or a built-in recipe's name"
) -> None:
    """The ``RECIPE`` argument and the repeatable ``--set SECTION.KEY=VALUE`` overrides (read
    back as ``args.recipe`` / ``args.overrides``) of every ``qwen35-train`` subcommand."""
    parser.add_argument("recipe", help=recipe_help)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one recipe value (repeatable), e.g. --set train.steps=5",
    )
