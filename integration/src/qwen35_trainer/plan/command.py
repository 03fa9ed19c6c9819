"""``qwen35-train plan RECIPE``: the plan's table (:mod:`qwen35_trainer.plan`); exit 0 when the
predicted peak fits ``--gpu-memory``, 3 when it does not, 2 for a recipe or layout that cannot
run. ``qwen35-train plan --sizes``: the GPUs each public size fine-tunes on.
``qwen35-train plan RECIPE --search``: every layout of the recipe's step on its GPUs (or
``--world-size``), pipeline parallelism included, best first (:mod:`.search`); exit 0 when one
fits."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qwen35_trainer.cli_common import EXIT_BAD_RECIPE, EXIT_DOES_NOT_FIT, add_recipe_arguments
from qwen35_trainer.recipe import load_recipe

__all__ = ["plan_main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen35-train plan",
        description="Memory and communication per GPU of a recipe, on a fake world (CPU only).",
    )
    add_recipe_arguments(parser)
    parser.add_argument("--world-size", type=int, help="ranks (rescales the data-parallel degree)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GiB")
    parser.add_argument("--json", metavar="FILE", help="also write the plan as JSON there")
    parser.add_argument(
        "--headroom",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="change a term beyond the counted tensors (repeatable): "
        "cuda_context_gib, cublas_gib, nccl_gib_per_group, fragmentation",
    )
    parser.add_argument(
        "--search",
        action="store_true",
        help="plan every layout of the recipe's step (pp, cp, FSDP or HSDP inside a node, ep) "
        "on its GPUs or --world-size, best first",
    )
    parser.add_argument(
        "--node-gpus", type=int, default=8, help="GPUs per node (--search; default 8)"
    )
    parser.add_argument(
        "--pp",
        type=lambda text: [int(v) for v in text.split(",")],
        metavar="P,P,...",
        help="the pipeline degrees --search tries (default: every divisor of the world)",
    )
    return parser


def plan_main(argv: list[str]) -> int:
    """The command (module docstring)."""
    if argv == ["--sizes"]:
        from qwen35_trainer.plan.sizes import size_table

        print(size_table())
        return 0
    args = _parser().parse_args(argv)
    from qwen35_trainer.plan import Headroom, format_plan, plan

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        headroom = Headroom.parse(args.headroom)
        if args.search:
            return _search(recipe, args, headroom)
        result = plan(
            recipe,
            name=str(args.recipe),
            world_size=args.world_size,
            gpu_memory_gib=args.gpu_memory,
            headroom=headroom,
        )
    except (OSError, ValueError) as err:
        print(f"qwen35-train plan: {err}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    print(format_plan(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2))
    return 0 if result.fits else EXIT_DOES_NOT_FIT


def _search(recipe, args, headroom) -> int:
    """``--search``: each candidate's line as it is decided, then the ranked table and the
    command that plans the best."""
    import functools

    from qwen35_trainer.plan import plan
    from qwen35_trainer.plan.search import search
    from qwen35_trainer.plan.search_report import format_candidate, format_search

    world = args.world_size or recipe.parallel.world
    if args.node_gpus < 1:
        raise ValueError(f"--node-gpus must be >= 1, got {args.node_gpus}")
    found = search(
        recipe,
        lambda sets: load_recipe(args.recipe, [*args.overrides, *sets]),
        world=world,
        node_gpus=args.node_gpus,
        gpu_memory_gib=args.gpu_memory,
        pp_values=args.pp,
        planner=functools.partial(plan, headroom=headroom),
        on_candidate=lambda c: print(format_candidate(c), flush=True),
    )
    print(format_search(found, str(args.recipe), args.overrides, world, args.gpu_memory))
    if args.json:
        rows = [
            {
                "sets": list(c.sets),
                "reason": c.reason,
                "inter_node_bytes": c.inter_node,
                "plan": c.plan.to_json() if c.plan else None,
            }
            for c in found
        ]
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if found and found[0].fits else EXIT_DOES_NOT_FIT
