"""``qwen35-train plan RECIPE [--world-size N] [--gpu-memory GiB] [--json FILE]``.

Prints the plan (:func:`qwen35_trainer.plan.plan`) as a table — the counted tensors, then each
term of what the GPU holds beyond them (:mod:`qwen35_trainer.plan.headroom`, changed with
``--headroom NAME=VALUE``) — and exits 0 when the predicted peak fits ``--gpu-memory`` (default
80 GiB), 3 when it does not, 2 for a recipe or layout
that cannot run (the reason is printed).
"""

from __future__ import annotations

import argparse
import json
import sys

from qwen35_trainer.plan import GIB, Headroom, Plan, plan
from qwen35_trainer.recipe import add_recipe_arguments, load_recipe

__all__ = ["EXIT_DOES_NOT_FIT", "format_plan", "plan_main"]

EXIT_DOES_NOT_FIT = 3


def format_plan(p: Plan) -> str:
    """The plan as the table the command prints."""
    layout = " x ".join(f"{k} {v}" for k, v in p.layout.items() if v > 1) or "one rank"
    lines = [
        f"plan: {p.recipe_name} on {p.world} ranks ({layout})",
        f"total parameters            {p.total_parameters / 1e9:10.2f} B",
        f"active parameters per token {p.active_parameters / 1e9:10.2f} B",
        "",
        "GiB per GPU          " + "".join(f"{'rank ' + str(r):>12}" for r in p.ranks),
    ]
    fields = list(next(iter(p.ranks.values())).__dataclass_fields__)
    for field in [*fields, "peak"]:
        values = "".join(f"{getattr(m, field) / GIB:12.2f}" for m in p.ranks.values())
        lines.append(f"  {'tensors counted' if field == 'peak' else field:<19}{values}")
    lines += ["", "beyond the counted tensors (--headroom NAME=VALUE to change)"]
    lines += [f"  {term:<27}{n / GIB:8.2f}" for term, n in p.headroom_terms.items()]
    lines += ["", "communication per step (GiB sent per rank)"]
    lines += [f"  {kind:<19}{n / GIB:12.2f}" for kind, n in p.communication.items()]
    verdict = "fits" if p.fits else "does NOT fit"
    lines += ["", f"predicted peak {p.peak_gib:.2f} GiB per GPU ({p.counted_gib:.2f} counted + "
              f"{p.peak_gib - p.counted_gib:.2f} headroom): {verdict} in "
              f"{p.gpu_memory_gib:g} GiB"]  # fmt: skip
    return "\n".join(lines)


def plan_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="qwen35-train plan", description=__doc__.split("\n\n")[0])
    add_recipe_arguments(parser)
    parser.add_argument("--world-size", type=int, help="ranks (rescales the data-parallel degree)")
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GiB")
    parser.add_argument("--json", metavar="FILE", help="also write the plan as JSON there")
    parser.add_argument("--headroom", action="append", default=[], metavar="NAME=VALUE",
                        help="change a term beyond the counted tensors (repeatable): "
                        "cuda_context_gib, cublas_gib, nccl_gib_per_group, fragmentation")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        result = plan(recipe, name=str(args.recipe), world_size=args.world_size,
                      gpu_memory_gib=args.gpu_memory,
                      headroom=Headroom.parse(args.headroom))  # fmt: skip
    except (OSError, ValueError) as err:
        print(f"qwen35-train plan: {err}", file=sys.stderr)
        return 2
    print(format_plan(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    return 0 if result.fits else EXIT_DOES_NOT_FIT
