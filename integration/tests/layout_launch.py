"""What the layout test files share: the one-process references, the tiny FP8 checkpoint, and
one layout's check in a launch (test_train_dp.py, test_train_compiled.py).

The layouts are split over several files, each with its own gloo launches, so that the suite's
two pytest-xdist workers (one file each at a time) share them; each file computes only the
references its layouts compare with.
"""

from __future__ import annotations

import pp_layouts
import train_layouts
from dist_checks import (
    STEPS,
    check_async_tp_equals_one_process,
    check_megatron_equals_one_process,
    check_training_equals_one_process,
    layout_recipe,
)
from fp8_dist_checks import check_fp8_equals_one_process
from fp8_fixtures import export_base, fp8_checkpoint
from pp_checks import check_pipeline_equals_one_process, check_pipeline_eval_and_export
from pp_layouts import PP_EXPORTED

from dist_testkit import named_check
from qwen35_trainer import train

# the layout tables, each launch running those of its file at its world size
LAYOUTS = {**train_layouts.LAYOUTS, **pp_layouts.PP_LAYOUTS}
VARIANTS = {**train_layouts.VARIANTS, **pp_layouts.PP_VARIANTS}
COMPARE = {**train_layouts.COMPARE, **pp_layouts.PP_COMPARE}


def check_of(layout: str):
    """The rank-side check of ``layout``: the megatron-fsdp and async-TP layouts' own, else
    the plain comparison with one process."""
    if layout.startswith("megatron"):
        return check_megatron_equals_one_process
    if layout.startswith("async_tp"):
        return check_async_tp_equals_one_process
    if "fp8" in layout:
        return check_fp8_equals_one_process
    if layout in PP_EXPORTED:
        return check_pipeline_eval_and_export
    if layout.startswith("pp"):
        return check_pipeline_equals_one_process
    return check_training_equals_one_process


def write_fp8_base(root):
    """A tiny checkpoint in Qwen's FP8 format (:func:`fp8_fixtures.fp8_checkpoint`)."""
    return fp8_checkpoint(root / "fp8", export_base(root / "bf16"))


def one_process_references(variants, fp8_base) -> dict:
    """The one-process run of each variant named: its step logs and final (fp32) parameters."""
    out = {}
    for name in sorted(set(variants)):
        recipe = layout_recipe(1, *(o.format(fp8=fp8_base) for o in VARIANTS[name]))
        with train(recipe) as result:
            # one-process bf16 runs FSDP2 on a one-rank group: its DTensors' local part is whole
            state = {k: v.detach().float().clone() for k, v in result.state_dict().items()}
        assert len(result.logs) == STEPS and result.logs[-1].loss < result.logs[0].loss
        out[name] = (result.logs, state)
    return out


def layout_checks(names, world: int, fill: dict, references: dict, extra_args: dict) -> dict:
    """``name -> check`` for each layout of ``names`` that runs at ``world``: its overrides
    filled from ``fill``, its reference and comparison, then ``extra_args[name]`` (folders)."""
    return {
        name: named_check(
            f"{name}@{world}",
            check_of(name),
            tuple(o.format(**fill) for o in LAYOUTS[name][0]),
            *references[LAYOUTS[name][1]],
            COMPARE.get(LAYOUTS[name][1]),
            *extra_args.get(name, ()),
        )
        for name in names
        if world in LAYOUTS[name][2]
    }
