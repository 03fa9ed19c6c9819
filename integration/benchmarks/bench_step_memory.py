"""Peak memory of one training step vs tokens per rank: this trainer vs transformers' own loss.

Both run the same Qwen3.5 MoE-VLM (the tiny recipe's shapes with a 65,536-token vocabulary, so
the logits matter as they do at 248,320) on the same samples, forward + backward, fp32 CPU:

- ``transformers``: the samples as right-padded rows, ``model(..., labels=...)`` — full
  [rows, S, V] logits, upcast to fp32 for the loss, and their gradient;
- ``qwen35-trainer``: the samples packed into one row (``data.packing``), cross-entropy from
  the hidden states in chunks (no [tokens, V] logits), documents kept apart by the layout (no
  [S, S] mask).

Each (variant, tokens) runs in a fresh subprocess; the number is its peak RSS minus the RSS once
the model and the batch exist (so it is the step's own working memory).

    python benchmarks/bench_step_memory.py                 # about 2K, 4K, 8K tokens per rank
    python benchmarks/bench_step_memory.py --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

RECIPE = "tiny"  # the built-in recipe (its model; this benchmark runs one process)
VOCAB = 65536
MIB = 1 << 20


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(variant: str, tokens: int) -> None:
    import torch

    from qwen35_trainer import TrainingObjective, build_model, load_recipe
    from qwen35_trainer.data import collate, rank_samples
    from qwen35_trainer.data.packing import pack
    from qwen35_trainer.model.packed import enable_packing

    torch.set_num_threads(1)
    samples_per_row = max(1, tokens // 190)  # ~190 tokens (text + image) per sample
    recipe = load_recipe(
        RECIPE,
        [
            f"model.text.vocab_size={VOCAB}",
            "model.image_token_id=65530",
            "model.video_token_id=65531",
            "model.vision_start_token_id=65532",
            "model.vision_end_token_id=65533",
            "model.expert_backend=torch",
            f"data.samples_per_rank={samples_per_row}",
            "data.text_tokens=[80, 100]",
            "data.path=null",
            "data.processor=null",
            "data.eval_path=null",
            "data.pack_length=null",
        ],
    )
    model = build_model(recipe.model)
    samples = rank_samples(recipe.model, recipe.data, step=0, rank=0, dp=1)
    if variant == "transformers":
        batch = collate(samples, pad_token_id=0)
        base = _rss()
        start = time.perf_counter()
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            mm_token_type_ids=batch.mm_token_type_ids,
            pixel_values=batch.pixel_values,
            image_grid_thw=batch.image_grid_thw,
            labels=batch.labels,
            use_cache=False,
        )
        out.loss.backward()
        n = int(batch.attention_mask.sum())
    else:
        enable_packing(model)
        objective = TrainingObjective(model)
        row, packed = pack(samples, model.config, pad_token_id=0)
        base = _rss()
        start = time.perf_counter()
        shares = objective(row, packed=packed)
        (shares.ce + 0.001 * shares.aux).backward()
        n = int(row.attention_mask.sum())
    seconds = time.perf_counter() - start
    print(json.dumps({"extra": _rss() - base, "tokens": n, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]))
        return
    print(f"vocab {VOCAB}, fp32 CPU, forward+backward of one step, peak RSS above the inputs")
    print(
        "| tokens | transformers (MiB) | qwen35-trainer (MiB) | memory ratio | time (s) ours / theirs |"
    )
    print("|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        result = {}
        for variant in ("transformers", "qwen35-trainer"):
            done = subprocess.run(
                [sys.executable, __file__, "--child", variant, str(tokens)],
                capture_output=True,
                text=True,
                check=True,
            )
            result[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        theirs, ours = result["transformers"], result["qwen35-trainer"]
        print(
            f"| {ours['tokens']} | {theirs['extra'] / MIB:.0f} | {ours['extra'] / MIB:.0f} | "
            f"{theirs['extra'] / max(ours['extra'], 1):.1f}x | "
            f"{ours['seconds']:.2f} / {theirs['seconds']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
