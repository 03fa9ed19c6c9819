"""Peak host memory per rank while the model is built and sharded with megatron-fsdp:
unit by unit from the meta device (``parallel.fsdp_backend: megatron``) vs the model
materialised whole first, in one run.

Every variant builds the same model (the tiny recipe widened to 8 decoder layers of 32 experts,
about 240 MB of fp32 weights) on gloo CPU ranks (megatron-fsdp's CUDA streams replaced by
:func:`dist_testkit.cpu_cuda_streams`), data parallel over every rank:

- ``megatron-fsdp, whole first``: the naive baseline, megatron-fsdp as its own examples use it —
  the model materialised whole on every rank (name-seeded), then sharded with megatron-fsdp's
  default mixed-precision policy (an fp32 main-weight buffer beside the weight buffer);
- ``whole first, no main copy``: the same, with the trainer's policy (``main_params_dtype=None``:
  for fp32 training the weight buffer is the optimizer's);
- ``qwen35-trainer``: the trainer's build — megatron-fsdp materialises the meta model one unit at
  a time, each module filled by name (:mod:`qwen35_trainer.parallel.megatron`), same policy;
- ``FSDP2``: the trainer's default backend, for scale (each rank allocates only its shards; its
  gradient shards come at the first backward, megatron-fsdp allocates its gradient buffer here).

The number is each rank's peak RSS growth over the build (:func:`dist_testkit.host_memory`:
``VmHWM`` reset after the imports), the largest over the ranks; ``held`` is the RSS growth left
when the build returns. Each
variant is a fresh launch.

    python benchmarks/bench_megatron_build.py              # world 4
    python benchmarks/bench_megatron_build.py --world 2
"""

from __future__ import annotations

import argparse
import contextlib

MIB = 1 << 20

# 8 decoder layers (3 Gated DeltaNet : 1 attention), 32 experts of width 256, hidden 256
SHAPE = (
    "model.text.hidden_size=256",
    "model.text.num_hidden_layers=8",
    "model.text.layer_types=[linear_attention, linear_attention, linear_attention, "
    "full_attention, linear_attention, linear_attention, linear_attention, full_attention]",
    "model.text.num_experts=32",
    "model.text.moe_intermediate_size=256",
    "model.text.vocab_size=4096",
    "model.vision.out_hidden_size=256",
    "parallel.cp=1",
    "parallel.ep=1",
)

VARIANTS = {
    "megatron-fsdp, whole first": ("megatron", "whole", "default"),
    "whole first, no main copy": ("megatron", "whole", "none"),
    "qwen35-trainer": ("megatron", "units", "none"),
    "FSDP2": ("fsdp2", None, None),
}


def _whole_first(real_filler):
    """A ``module_filler`` that materialises and fills every module before megatron-fsdp
    starts: megatron-fsdp then copies its ranges out of the whole model."""

    def filler(model, device, **kwargs):
        fill = real_filler(model, device, **kwargs)
        for module in model.modules():
            if next(module.parameters(recurse=False), None) is not None:
                module.to_empty(device=device, recurse=False)
                fill(module)
        return fill

    return filler


def _measure(variant: str, world: int) -> dict[str, int]:
    from unittest import mock

    import torch
    import torch.distributed as dist

    import qwen35_trainer.model.build as build
    import qwen35_trainer.parallel.megatron as megatron
    from dist_testkit import cpu_cuda_streams, host_memory
    from fsdp_compat import MixedPrecision
    from qwen35_trainer import build_training_model, load_recipe

    torch.set_num_threads(1)
    backend, fill, policy = VARIANTS[variant]
    recipe = load_recipe(
        "tiny", [*SHAPE, f"parallel.dp={world}", f"parallel.fsdp_backend={backend}"]
    )
    with contextlib.ExitStack() as patches:
        patches.enter_context(cpu_cuda_streams())
        if fill == "whole":
            patches.enter_context(
                mock.patch.object(build, "module_filler", _whole_first(build.module_filler))
            )
        if policy == "default":  # megatron-fsdp's own MixedPrecisionPolicy()
            patches.enter_context(
                mock.patch.object(megatron, "MixedPrecision", lambda **_: MixedPrecision())
            )
        with host_memory() as used:
            objective, _ = build_training_model(recipe, torch.device("cpu"))
        del objective  # held: measured while it was alive
    full = sum(
        p.numel() * p.element_size() for p in build.build_meta_model(recipe.model).parameters()
    )
    dist.barrier()
    return {"peak": used.peak, "held": used.held, "model": full}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args()

    from dist_testkit import launch

    rows = {}
    for variant in VARIANTS:
        outcomes = launch(
            _measure,
            args.world,
            variant,
            args.world,
            timeout=600,
            # large blocks straight from mmap, so memory freed is given back and RSS falls
            env={"MALLOC_MMAP_THRESHOLD_": "131072"},
        )
        failed = [o.error for o in outcomes if not o.ok]
        if failed:
            raise SystemExit(f"{variant} failed:\n{failed[0]}")
        rows[variant] = [o.value for o in outcomes]
    model = rows["qwen35-trainer"][0]["model"]
    print(f"world {args.world}, fp32 weights {model / MIB:.0f} MiB, per rank (largest rank)")
    print("| variant | peak (MiB) | held after (MiB) | peak / qwen35-trainer | peak / model |")
    print("|---|---:|---:|---:|---:|")
    ours = max(r["peak"] for r in rows["qwen35-trainer"])
    for variant, ranks in rows.items():
        peak, held = max(r["peak"] for r in ranks), max(r["held"] for r in ranks)
        print(
            f"| {variant} | {peak / MIB:.0f} | {held / MIB:.0f} | {peak / ours:.2f}x | "
            f"{peak / model:.2f}x |"
        )


if __name__ == "__main__":
    main()
