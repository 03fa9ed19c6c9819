"""What the checkpoint manifest costs: save time with the checksums computed while writing vs
the same state saved by DCP's own file writer (what torchtitan's checkpointer calls), on the
tiny recipe's checkpoint and on a 1 GiB one (model + AdamW state), in one run.

- ``dcp``: ``torch.distributed.checkpoint.save`` with its default ``FileSystemWriter`` (one
  file per rank, one thread, fsync'd);
- ``dcp-2t``: the same writer with two threads (two files per rank), the layout ours writes;
- ``qwen35-trainer``: :func:`qwen35_trainer.train.checkpoint.save_checkpoint` — DCP's save through
  :class:`~qwen35_trainer.train.integrity.ChecksummingWriter` (two threads, each hashing the bytes it
  writes), the gather of the records, the trainer's files, the manifest and the atomic rename.

Rounds rotate the order of the three, each save into a fresh directory after ``os.sync`` (so
one save's writeback does not slow the next), and the median of each is kept; the table prints
the ratios. On a shared disk a writer's time varies by ±20 % from round to round, more than the
checksum costs, so ``checksum`` isolates the checksum's own work: XXH3 over the checkpoint's
bytes in memory, in the buffer sizes a writer sees, as a share of the default DCP save time.
``verify`` is the time to check a checkpoint against its manifest (read back and hashed; paid
at resume, not at save).

    python benchmarks/bench_checkpoint.py              # tiny and 1 GiB, 6 rounds
    python benchmarks/bench_checkpoint.py --gib 4 --rounds 3 --dir /mnt/shared
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from qwen35_trainer import load_recipe, train
from qwen35_trainer.train.checkpoint import save_checkpoint
from qwen35_trainer.train.integrity import verify

MIB = 2**20


def _tiny():
    recipe = load_recipe(
        "tiny",
        ["parallel.dp=1", "parallel.cp=1", "parallel.ep=1", "train.steps=1", "train.eval_every=0"],
    )
    result = train(recipe)
    return result.objective, result.optimizer


def _large(gib: float):
    """A stack of square linears whose fp32 weights and two AdamW moments make ``gib`` GiB."""
    width = 4096
    layers = max(1, round(gib * 2**30 / 3 / (width * width * 4)))
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the moments
    return model, optimizer


def _dcp(threads: int):
    def save(model, optimizer, path: Path) -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": torch.tensor(1)}
        dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=threads))

    return save


def _ours(model, optimizer, path: Path) -> None:
    save_checkpoint(path, 1, model, optimizer, files={"recipe.yaml": ""})


WRITERS = {"dcp": _dcp(1), "dcp-2t": _dcp(2), "qwen35-trainer": _ours}


def _hash_seconds(path: Path) -> float:
    """The checksum's own work for the checkpoint at ``path``: XXH3 over each file's bytes, in
    memory, in 4 MiB buffers (what the writer adds, without the disk's noise)."""
    blobs = [p.read_bytes() for p in sorted(path.iterdir()) if p.name != "manifest.json"]
    began = time.perf_counter()
    for blob in blobs:
        digest = xxhash.xxh3_64()
        for at in range(0, len(blob), 1 << 22):
            digest.update(memoryview(blob)[at : at + (1 << 22)])
    return time.perf_counter() - began


def _measure(model, optimizer, rounds: int, root: Path) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in (*WRITERS, "verify", "hash", "size")}
    names = list(WRITERS)
    for r in range(rounds):
        for name in names[r % 3 :] + names[: r % 3]:
            path = root / f"{name}_{r}"
            os.sync()
            began = time.perf_counter()
            WRITERS[name](model, optimizer, path)
            times[name].append(time.perf_counter() - began)
        ours = root / f"qwen35-trainer_{r}" / "step_000001"
        times["hash"].append(_hash_seconds(ours))
        began = time.perf_counter()
        assert verify(ours).state == "intact"
        times["verify"].append(time.perf_counter() - began)
        times["size"] = [sum(p.stat().st_size for p in (root / f"dcp_{r}").iterdir())]
        for name in names:
            shutil.rmtree(root / f"{name}_{r}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the large checkpoint")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    root = Path(tempfile.mkdtemp(dir=args.dir))
    cases = {"tiny": _tiny(), f"{args.gib:g} GiB": _large(args.gib)}  # tiny makes the group
    assert dist.is_initialized()
    print(
        f"torch={torch.__version__} threads={torch.get_num_threads()} dir={root}; "
        f"median of {args.rounds} rounds, order rotated"
    )
    print(
        "| checkpoint |   MiB |  dcp s | dcp-2t s | qwen35-trainer s | ours/dcp | ours/dcp-2t "
        "| checksum s | checksum/dcp | verify s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (model, optimizer) in cases.items():
        t = {
            k: statistics.median(v)
            for k, v in _measure(model, optimizer, args.rounds, root).items()
        }
        plain, two, ours = t["dcp"], t["dcp-2t"], t["qwen35-trainer"]
        print(
            f"| {name} | {t['size'] / MIB:.0f} | {plain:.3f} | {two:.3f} | {ours:.3f} | "
            f"{ours / plain:.3f}x | {ours / two:.3f}x | {t['hash']:.4f} | "
            f"{100 * t['hash'] / plain:.1f}% | {t['verify']:.3f} |",
            flush=True,
        )
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
