"""``setup-prewarm``: prewarm a process-group layout and print the report (a health check).

Run it under ``torchrun`` (the default process group is initialised from the ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` environment variables) or alone (a one-rank
group on an in-memory store). When the default group already exists (a caller initialised it),
it is used and left in place. It builds the DeviceMesh ``--mesh`` with ``--names``, optionally
flattens named dim combinations (``--flatten dp,tp``, repeatable), all-reduces once on every
distinct group, warms cuBLAS on a GPU, prints every rank's report, and exits 1 when any step
failed on this rank (2 for bad arguments), else 0::

    torchrun --nproc-per-node 8 -m setup_prewarm.cli --mesh 2x4 --names dp,tp --flatten dp,tp
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from setup_prewarm.runner import prewarm

__all__ = ["build_parser", "main"]


def _mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 2x4, got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"mesh sizes must be positive, got {text!r}")
    return shape


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    if not all(names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated names, got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="setup-prewarm",
        description="Prewarm cuBLAS and every process group of a DeviceMesh; print a report.",
    )
    parser.add_argument("--mesh", type=_mesh_shape, help="mesh shape, e.g. 2x4 (default: world)")
    parser.add_argument("--names", type=_names, help="mesh dim names, e.g. dp,tp")
    parser.add_argument(
        "--flatten",
        type=_names,
        action="append",
        default=[],
        help="dims to flatten into one more group, e.g. dp,tp (repeatable)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    parser.add_argument("--backend", help="process-group backend (default: torch's choice)")
    parser.add_argument("--no-cublas", action="store_true", help="skip the cuBLAS step")
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    shape = args.mesh or (world,)
    names = args.names or tuple(f"dim{i}" for i in range(len(shape)))
    if len(names) != len(shape):
        parser.error(f"--names has {len(names)} names for a {len(shape)}-dim --mesh {shape}")
    if math.prod(shape) != world:
        parser.error(
            f"--mesh {'x'.join(map(str, shape))} holds {math.prod(shape)} ranks, world is {world}"
        )
    for combo in args.flatten:
        unknown = [n for n in combo if n not in names]
        if unknown or len(combo) < 2:
            parser.error(f"--flatten {','.join(combo)}: need 2+ of the mesh names {names}")
        order = [names.index(n) for n in combo]
        if order != sorted(order):
            parser.error(f"--flatten {','.join(combo)}: list the dims in mesh order {names}")
    args.mesh, args.names = shape, names


def _init_default_group(backend: str | None, device_type: str) -> bool:
    """Initialise the default group unless it exists; True when this call created it."""
    if dist.is_initialized():
        return False
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 a step failed, 2 bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    try:
        _validate(parser, args, world)
    except SystemExit as exc:
        return int(exc.code or 2)
    created = _init_default_group(args.backend, device_type)
    try:
        mesh = init_device_mesh(device_type, args.mesh, mesh_dim_names=args.names)
        meshes: list[DeviceMesh] = [mesh]
        meshes += [mesh[combo]._flatten() for combo in args.flatten]
        report = prewarm(
            device=None if device_type == "cuda" else "cpu",
            cublas=not args.no_cublas,
            fla=False,
            groups=meshes,
        )
        rank = dist.get_rank()
        print(f"[rank {rank}/{dist.get_world_size()}] {report}", flush=True)
        return 0 if report.ok else 1
    finally:
        if created:
            dist.destroy_process_group()


def run() -> NoReturn:
    """The ``setup-prewarm`` command: :func:`main`, then the process ends with its exit code
    without the interpreter's teardown. A gloo group's threads abort that teardown now and then
    ("terminate called without an active exception", exit -6) even after the group is
    destroyed, and a finished prewarm would read as failed."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
