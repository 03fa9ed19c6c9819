"""``qwen35-train data make-demo DIR``: write the demo dataset (:mod:`qwen35_trainer.data.demo`).
``qwen35-train data check RECIPE [--set ...] [--limit N]``: read the recipe's dataset through its
processor, one row after another in file order, and print what a run would get: rows, samples,
images, videos, tokens, the packed rows and their fill (first-fit in file order, as the loader
packs), the samples over capacity, and every bad row with its reason.

Exit status: 0 every row is good; 3 some rows are bad (listed); 2 a bad recipe or dataset.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["data_main"]

EXIT_BAD_ROWS = 3


def _check(recipe, limit: int | None) -> int:
    from qwen35_trainer.data.conversation import ConversationEncoder, DataError
    from qwen35_trainer.data.demo import resolve
    from qwen35_trainer.data.loader import open_rows
    from qwen35_trainer.model import build_config

    data, model = recipe.data, recipe.model
    if not data.path:
        raise ValueError("data check needs data.path (a data.source iterable is the user's code)")
    encoder = ConversationEncoder.from_recipe(data, model, build_config(model),
                                              resolve(data.processor))  # fmt: skip
    encoder.check_template()
    path = resolve(data.path)
    rows, base = open_rows(path, data.split)
    count = len(rows) if limit is None else min(limit, len(rows))
    lengths, bad = [], []
    images = videos = labels = 0
    for index in range(count):
        where = f"{path}:{index}"
        try:
            sample = encoder(rows[index], where, base)
        except DataError as error:
            bad.append(str(error))
            continue
        lengths.append(len(sample))
        images += len(sample.image_grid_thw)
        videos += len(sample.video_grid_thw)
        labels += int((sample.labels >= 0).sum())
    capacity = data.pack_length
    over = sum(n > capacity for n in lengths)
    fitting = [n for n in lengths if n <= capacity]
    packed = first_fit_rows(fitting, capacity, data.rows_per_step(1))
    tokens = sum(lengths)
    print(f"dataset     {path} ({count} of {len(rows)} rows read)")
    print(f"processor   {resolve(data.processor)}")
    print(f"samples     {len(lengths)} good, {len(bad)} bad")
    print(f"media       {images} images, {videos} videos")
    if lengths:
        print(f"tokens      {tokens} (mean {tokens / len(lengths):.1f}, max {max(lengths)}), "
              f"{labels} trained (data.train_on={data.train_on})")  # fmt: skip
    print(f"packed rows {packed} of {capacity} tokens, fill "
          f"{sum(fitting) / (packed * capacity) if packed else 0:.3f}")  # fmt: skip
    print(f"over capacity {over} (data.over_capacity={data.over_capacity})")
    for message in bad:
        print(f"bad row     {message}")
    return EXIT_BAD_ROWS if bad else 0


def first_fit_rows(lengths: list[int], capacity: int, rows_per_step: int) -> int:
    """Rows used when documents of ``lengths`` fill ``rows_per_step`` rows per step first-fit in
    order, the first document that fits none opening the next step (the loader's rule)."""
    used, room = 0, []
    for n in lengths:
        fits = next((r for r in range(len(room)) if n <= room[r]), None)
        if fits is None and len(room) == rows_per_step:
            used += sum(1 for r in room if r < capacity)
            room = []
        if fits is None:
            room = room or [capacity] * rows_per_step
            fits = next(r for r in range(len(room)) if n <= room[r])
        room[fits] -= n
    return used + sum(1 for r in room if r < capacity)


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
