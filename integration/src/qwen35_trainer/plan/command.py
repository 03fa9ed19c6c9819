"""``qwen35-train plan RECIPE``: the plan's table (:mod:`qwen35_trainer.plan`); exit 0 when the
predicted peak fits ``--gpu-memory``, 3 when it does not, 2 for a recipe or layout that cannot
run; the step's time on ``--gpu`` (:mod:`.timing`). ``qwen35-train plan --sizes``: the GPUs each
public size fine-tunes on. ``qwen35-train plan --published``: the step-time model against the
published Qwen3.6-35B-A3B runs (:mod:`.published`). ``qwen35-train plan RECIPE --search``: every
layout of the recipe's step on its GPUs (or ``--world-size``), pipeline parallelism included,
fastest first (:mod:`.search`); exit 0 when one fits."""

from __future__ import annotations

import argparse
import dataclasses
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
    parser.add_argument(
        "--gpu-memory", type=float, metavar="GiB", help="the verdict's memory (default: --gpu's)"
    )
    parser.add_argument(
        "--gpu", default="h100", help="the GPU the step is timed on: h100 (default), h200, b200"
    )
    parser.add_argument(
        "--gpu-set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="change a field of --gpu's profile (repeatable): bf16_tflops, hbm_tbps, "
        "nvlink_gbps, ib_gbps (one way, per GPU), memory_gib",
    )
    parser.add_argument(
        "--efficiency",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="change an efficiency of the step-time model (repeatable): matmul, head, grouped, "
        "attention, recurrence, nvlink, ib, hbm",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the plan as JSON there")
    timed = parser.add_mutually_exclusive_group()
    timed.add_argument(
        "--measure",
        metavar="FILE",
        help="time the plan's op classes, calls, optimizer and local link on this machine, "
        "write that profile to FILE and predict the step with it",
    )
    timed.add_argument(
        "--profile", metavar="FILE", help="predict the step with a profile --measure wrote"
    )
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
        "on its GPUs or --world-size, fastest first",
    )
    parser.add_argument(
        "--node-gpus",
        type=int,
        default=8,
        help="GPUs per node (default 8): which groups span nodes",
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
    if argv == ["--published"]:
        from qwen35_trainer.plan.published import published_table

        print(published_table())
        return 0
    args = _parser().parse_args(argv)
    from qwen35_trainer.plan import Headroom, format_plan, plan
    from qwen35_trainer.plan.hardware import hardware
    from qwen35_trainer.plan.timing import Efficiency, step_time

    try:
        recipe = load_recipe(args.recipe, args.overrides, hub_weights=False)
        headroom = Headroom.parse(args.headroom)
        gpu = hardware(args.gpu, args.gpu_set)
        efficiency = Efficiency.parse(args.efficiency, gpu)
        if args.node_gpus < 1:
            raise ValueError(f"--node-gpus must be >= 1, got {args.node_gpus}")
        memory = args.gpu_memory if args.gpu_memory is not None else gpu.memory_gib
        if args.search:
            return _search(recipe, args, headroom, gpu, efficiency, memory)
        result = plan(
            recipe,
            name=str(args.recipe),
            world_size=args.world_size,
            gpu_memory_gib=memory,
            headroom=headroom,
        )
        profile = _profile(args, recipe, result)
        result = _measured_reserve(result, profile, args.headroom)
        timing = step_time(result, gpu, efficiency, args.node_gpus, profile)
    except (OSError, ValueError) as err:
        print(f"qwen35-train plan: {err}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    print(format_plan(result, timing))
    if args.json:
        Path(args.json).write_text(json.dumps(_json(result, timing), indent=2))
    return 0 if result.fits else EXIT_DOES_NOT_FIT


def _profile(args, recipe, planned):
    """The measured profile ``--measure`` takes (and writes) or ``--profile`` reads; else
    ``None`` (the datasheet model)."""
    from qwen35_trainer.plan.profile import Profile

    if args.profile:
        return Profile.load(args.profile)
    if not args.measure:
        return None
    from qwen35_trainer.plan.measure import measure_profile

    profile = measure_profile(recipe, planned, str(args.recipe))
    profile.save(args.measure)
    print(f"qwen35-train plan: measured profile written to {args.measure}", file=sys.stderr)
    return profile


def _measured_reserve(planned, profile, stated: list[str]):
    """``planned`` with the allocator reserve a GPU profile measured
    (:attr:`.profile.Profile.fragmentation`), unless ``--headroom fragmentation=`` states one."""
    if profile is None or profile.fragmentation is None:
        return planned
    if any(item.startswith("fragmentation=") for item in stated):
        return planned
    headroom = dataclasses.replace(planned.headroom, fragmentation=profile.fragmentation)
    return dataclasses.replace(planned, headroom=headroom)


def _json(planned, timing) -> dict:
    """The plan's JSON with its step time."""
    if timing is None:
        return planned.to_json()
    return {
        **planned.to_json(),
        "step_time": {
            "gpu": timing.gpu.name if timing.profile is None else timing.profile.device,
            "seconds": timing.seconds,
            "compute_seconds": timing.compute,
            "exposed_seconds": timing.exposed,
            "pipeline_idle_seconds": timing.pipeline_idle,
            "optimizer_seconds": timing.optimizer,
            "tokens_per_second_per_gpu": timing.tokens_per_gpu,
            "model_tflops_per_gpu": timing.tflops_per_gpu,
            "mfu": timing.mfu,
        },
    }


def _search(recipe, args, headroom, gpu, efficiency, memory) -> int:
    """``--search``: each candidate's line as it is decided, then the ranked table and the
    command that plans the best."""
    import functools

    from qwen35_trainer.plan import plan
    from qwen35_trainer.plan.search import search
    from qwen35_trainer.plan.search_report import format_candidate, format_search

    world = args.world_size or recipe.parallel.world
    found = search(
        recipe,
        lambda sets: load_recipe(args.recipe, [*args.overrides, *sets], hub_weights=False),
        world=world,
        node_gpus=args.node_gpus,
        gpu_memory_gib=memory,
        pp_values=args.pp,
        planner=functools.partial(plan, headroom=headroom),
        on_candidate=lambda c: print(f"searched:{format_candidate(c)}", file=sys.stderr),
        gpu=gpu,
        efficiency=efficiency,
    )
    print(format_search(found, str(args.recipe), args.overrides, world, memory, gpu, recipe))
    if args.json:
        rows = [
            {
                "sets": list(c.sets),
                "reason": c.reason,
                "inter_node_bytes": c.inter_node,
                "plan": _json(c.plan, c.time) if c.plan else None,
            }
            for c in found
        ]
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if found and found[0].fits else EXIT_DOES_NOT_FIT
