"""What the checkpoint manifest costs: save time with the checksums computed while writing vs
the same state saved by DCP's own file writer (what torchtitan's checkpointer calls), on the
tiny recipe's checkpoint and on a 1 GiB one (model + AdamW state), in one run.

- ``dcp``: ``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` (fsync'd files);
- ``qwen35-trainer``: :func:`qwen35_trainer.checkpoint.save_checkpoint` — the same DCP save
  through :class:`~qwen35_trainer.integrity.ChecksummingWriter`, plus the gather of the
  records, the trainer's files, the manifest and the atomic rename.

Rounds are interleaved (dcp, ours, dcp, ours, ...) into fresh directories and the median of
each is kept; the table prints the ratio. ``verify`` is the time to check the checkpoint
against its manifest (read back and hashed; paid at resume, not at save).

    python benchmarks/bench_checkpoint.py              # tiny and 1 GiB, 5 rounds
    python benchmarks/bench_checkpoint.py --gib 4 --rounds 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from qwen35_trainer import load_recipe, train
from qwen35_trainer.checkpoint import save_checkpoint
from qwen35_trainer.integrity import verify

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


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def _measure(model, optimizer, rounds: int, root: Path) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"dcp": [], "qwen35-trainer": [], "verify": []}
    for r in range(rounds):
        plain = root / f"dcp_{r}"
        began = time.perf_counter()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": torch.tensor(1)}
        dcp.save(state, storage_writer=FileSystemWriter(plain))
        times["dcp"].append(time.perf_counter() - began)
        began = time.perf_counter()
        ours = save_checkpoint(root / f"ours_{r}", 1, model, optimizer, files={"recipe.yaml": ""})
        times["qwen35-trainer"].append(time.perf_counter() - began)
        began = time.perf_counter()
        assert verify(ours).state == "intact"
        times["verify"].append(time.perf_counter() - began)
        size = _bytes(plain)
        shutil.rmtree(plain)
        shutil.rmtree(root / f"ours_{r}")
    times["size"] = [size]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the large checkpoint")
    parser.add_argument("--rounds", type=int, default=5)
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
        f"median of {args.rounds} interleaved rounds"
    )
    print("| checkpoint |   MiB |  dcp s | qwen35-trainer s | ours/dcp | verify s |")
    print("|------------|-------|--------|------------------|----------|----------|")
    for name, (model, optimizer) in cases.items():
        t = _measure(model, optimizer, args.rounds, root)
        plain, ours = statistics.median(t["dcp"]), statistics.median(t["qwen35-trainer"])
        print(
            f"| {name:10} | {t['size'][0] / MIB:5.0f} | {plain:6.3f} | {ours:16.3f} | "
            f"{ours / plain:7.3f}x | {statistics.median(t['verify']):8.3f} |",
            flush=True,
        )
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
