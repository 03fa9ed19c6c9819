"""``qwen35-train data make-demo DIR``: write the demo dataset (:mod:`qwen35_trainer.data.demo`).
``qwen35-train data check RECIPE [--set ...] [--limit N]``: read the recipe's dataset (its first
N rows) through the run's own loader (:class:`~qwen35_trainer.data.loader.DataStream`, one
process, every shard, one pass) and print what a run would get: samples, images, videos and the
frames sampled from them, tokens, the packed rows and their fill (the loader's dealing and
packing, so they are the run's), the samples over capacity, and every bad row with its reason.

Exit status: 0 every row is good; 3 some rows are bad (listed); 2 a bad recipe or dataset.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["data_main"]

EXIT_BAD_ROWS = 3


def _check(recipe, limit: int | None) -> int:
    import dataclasses

    import torch

    from qwen35_trainer.data.demo import resolve
    from qwen35_trainer.data.loader import DataStream, open_rows
    from qwen35_trainer.model import build_config
    from qwen35_trainer.parallel import Layout

    data = recipe.data
    if not data.path:
        raise ValueError("data check needs data.path (a data.source iterable is the user's code)")
    path = resolve(data.path)
    total = len(open_rows(path, data.split)[0])
    count = total if limit is None else min(limit, total)
    # the run's own loader, one process (every shard), over one pass of the rows, bad rows
    # skipped and listed
    checked = dataclasses.replace(recipe, data=dataclasses.replace(data, on_bad_row="skip"))
    config = build_config(recipe.model)
    stream = DataStream(checked, config, Layout(), torch.device("cpu"), limit=count,
                        max_skipped=None)  # fmt: skip
    docs, rows, over = [], 0, 0
    while True:
        step = stream.next_step()
        found = [row for row in step.rows if row]
        if not found and not step.skipped and not step.truncated + step.dropped:
            break
        rows += len(found)
        docs += [doc for row in found for doc in row]
        over += step.truncated + step.dropped
    temporal = config.vision_config.temporal_patch_size
    frames = [int(t) * temporal for doc in docs for t in doc.video_grid_thw[:, 0]]
    tokens = sum(len(d) for d in docs)
    print(f"dataset     {path} ({count} of {total} rows read)")
    print(f"processor   {resolve(data.processor)}")
    print(f"samples     {len(docs)} good, {len(stream.skipped)} bad")
    print(f"media       {sum(len(d.image_grid_thw) for d in docs)} images, {len(frames)} videos"
          + (f" ({min(frames)}-{max(frames)} frames sampled)" if frames else ""))  # fmt: skip
    if docs:
        labels = sum(int((d.labels >= 0).sum()) for d in docs)
        print(f"tokens      {tokens} (mean {tokens / len(docs):.1f}, "
              f"max {max(len(d) for d in docs)}), {labels} trained "
              f"(data.train_on={data.train_on})")  # fmt: skip
    capacity = data.pack_length
    print(f"packed rows {rows} of {capacity} tokens, fill "
          f"{tokens / (rows * capacity) if rows else 0:.3f} (data.global_batch="
          f"{data.rows_per_step(1)} rows per step, the loader's packing)")  # fmt: skip
    print(f"over capacity {over} (data.over_capacity={data.over_capacity})")
    for message in stream.skipped:
        print(f"bad row     {message}")
    return EXIT_BAD_ROWS if stream.skipped else 0


def data_main(argv: list[str]) -> int:
    from qwen35_trainer.recipe import add_recipe_arguments, load_recipe

    parser = argparse.ArgumentParser(prog="qwen35-train data", description=__doc__.split("\n")[0])
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
        from qwen35_trainer.data.demo import make_demo

        root = make_demo(args.dir, train_rows=args.train_rows, heldout_rows=args.heldout_rows)
        print(f"wrote the demo dataset to {root}: train.jsonl ({args.train_rows} rows), "
              f"heldout.jsonl ({args.heldout_rows} rows), images/, videos/, processor/")  # fmt: skip
        return 0
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        return _check(recipe, args.limit)
    except (OSError, ValueError) as error:
        print(f"qwen35-train data: {error}", file=sys.stderr)
        return 2
