"""Activations saved for the backward per rank: TP 2 with sequence parallelism vs without.

Sequence parallelism (``parallel.sequence_parallel``, on by default with ``tp > 1``) splits the
residual stream, the norms, the routers and the routed experts' tokens over the TP ranks; without
it every TP peer keeps the same activations there. Both layouts run the tiny recipe's model on the
same packed rows (gloo, CPU, fp32), with and without activation checkpointing; the number is the
bytes the forward's autograd graph saves on each rank
(:func:`qwen35_trainer.plan.measured.saved_activation_bytes`: storages once, parameters out).
The one-process run (TP 1) is printed for scale. The peer: torchtitan runs TP with SP always
(Megatron-style); its models are not this one, so the comparison here is the naive baseline, the
same trainer with SP off.

    python benchmarks/bench_sequence_parallel.py                # 4 rows of ~400 tokens
    python benchmarks/bench_sequence_parallel.py --tokens 800
"""

from __future__ import annotations

import argparse

MIB = 1 << 20


def _measure(overrides: tuple[str, ...]) -> dict:
    import torch

    from qwen35_trainer import load_recipe
    from qwen35_trainer.plan.measured import saved_activation_bytes

    torch.set_num_threads(1)
    return saved_activation_bytes(load_recipe("tiny", list(overrides)))


# the tiny recipe's model with the public sizes' proportions in miniature: 16 layers (3 Gated
# DeltaNet : 1 attention), 16 experts of which 8 routed per token, expert width H / 4
SHAPE = (
    "model.text.hidden_size=64",
    "model.text.num_hidden_layers=16",
    f"model.text.layer_types=[{', '.join(['linear_attention'] * 3 + ['full_attention'])}"
    f"{', linear_attention, linear_attention, linear_attention, full_attention' * 3}]",
    "model.text.num_experts=16",
    "model.text.num_experts_per_tok=8",
    "model.text.moe_intermediate_size=16",
    "model.text.shared_expert_intermediate_size=16",
    "model.vision.out_hidden_size=64",
)


def _layout(tokens: int, tp: int, sp: bool | None, ac: bool) -> tuple[str, ...]:
    return (
        *SHAPE,
        "parallel.dp=1",
        "parallel.cp=1",
        "parallel.ep=1",
        f"parallel.tp={tp}",
        f"parallel.sequence_parallel={'null' if sp is None else str(sp).lower()}",
        "data.packing=true",
        "data.samples_per_rank=4",
        f"data.text_tokens=[{tokens}, {tokens}]",
        "data.path=null",
        "data.processor=null",
        "data.eval_path=null",
        "data.pack_length=null",
        "model.expert_backend=torch",
        f"train.activation_checkpointing={str(ac).lower()}",
    )


def main() -> None:
    from dist_testkit import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400, help="text tokens per document")
    args = parser.parse_args()
    print(f"saved activations per rank (MiB), 4 documents of {args.tokens} text tokens + image")
    print(f"{'checkpointing':>14} {'TP 1':>9} {'TP 2':>9} {'TP 2 + SP':>10} {'SP / no SP':>11}")
    for ac in (False, True):
        one = _measure(_layout(args.tokens, 1, None, ac))["saved"]
        per = {}
        for sp in (False, True):
            outcomes = launch(_measure, 2, _layout(args.tokens, 2, sp, ac), timeout=600)
            failed = [o.error for o in outcomes if not o.ok]
            if failed:
                raise SystemExit(failed[0])
            per[sp] = max(o.value["saved"] for o in outcomes)
        print(
            f"{'on' if ac else 'off':>14} {one / MIB:9.1f} {per[False] / MIB:9.1f} "
            f"{per[True] / MIB:10.1f} {per[True] / per[False]:10.2f}x"
        )


if __name__ == "__main__":
    main()
