"""One step of a recipe on this rank, timed and counted, for :mod:`.measure` and
:mod:`.layout_cost`: the model built by the trainer's own code (:func:`build_training_model`
on the process group that is running, or a one-process group it starts), step 0's
micro-batches from the recipe's own data feed, then — each after a warm-up, the median of
:data:`REPEATS` runs — one micro-batch's forward, its forward and backward, and the trainer's
whole step (:func:`qwen35_trainer.train.pipeline_step.step_function`: every micro-batch,
clipping, the optimizer), each with the aten op calls it makes (:class:`CallCounter`), and the
feed's seconds per step."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CallCounter",
    "Probe",
    "TrainerStep",
    "probe_step",
    "process_group",
    "single_process",
    "timed",
    "trainer_step",
]

REPEATS = 3


class CallCounter(TorchDispatchMode):
    """Counts the aten op calls made while it is active (forward and autograd's backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int = REPEATS):
    """``(seconds, calls)`` of ``fn``: the median of ``repeats`` runs after a warm-up, and the
    op calls one run makes."""
    fn()
    counter = CallCounter()
    with counter:
        fn()
    seconds = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), counter.calls


def single_process(recipe):
    """The recipe with every degree 1 (one process runs all of it)."""
    ones = dict(pp=1, dp_replicate=1, dp=1, cp=1, tp=1, ep=1, async_tp=False, pp_layers=None)
    return dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, **ones))


@dataclasses.dataclass(frozen=True)
class Probe:
    """What :func:`probe_step` measured: ``seconds`` and ``calls`` of ``microbatch`` (forward
    and backward), ``forward`` and ``step``; the feed's ``data_s``; the micro-batches; the
    patch grids ``[t, h, w]`` of the timed micro-batch's images and videos."""

    seconds: dict[str, float]
    calls: dict[str, float]
    data_s: float
    microbatches: int
    config: Any
    grids: tuple = ()


@contextlib.contextmanager
def process_group(device: torch.device):
    """The running process group, or, where none runs, a group of this process alone for the
    block (on the device's own backend: NCCL needs CUDA tensors)."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()


@dataclasses.dataclass
class TrainerStep:
    """The trainer's own step of a recipe on this rank, ready to run: ``run()`` is
    :func:`qwen35_trainer.train.pipeline_step.step_function` over step 0's micro-batches
    (``micro``) with an AdamW optimizer."""

    objective: Any
    layout: Any
    feed: Any
    micro: list
    optimizer: Any
    run: Callable[[], None]


def trainer_step(recipe, device: torch.device, dims=None) -> TrainerStep:
    """:class:`TrainerStep` of ``recipe`` built by the trainer's code on the running process
    group (``dims``: its layout; ``None``: one process)."""
    from qwen35_trainer.data.feed import Feed
    from qwen35_trainer.model import build_training_model
    from qwen35_trainer.train.pipeline_step import step_function
    from safe_optim import build_optimizer

    objective, layout = build_training_model(recipe, device, dims=dims)
    feed = Feed(recipe, objective.model.config, layout, device)
    micro, _ = feed.step(0)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, "adamw", lr=1e-6)

    def run():
        step_function(objective)(
            objective,
            optimizer,
            micro,
            layout,
            aux_coef=0.001,
            grad_clip=recipe.train.grad_clip,
            device=device,
        )

    return TrainerStep(objective, layout, feed, micro, optimizer, run)


def probe_step(recipe, device: torch.device, dims=None) -> Probe:
    """The module docstring's measurements of ``recipe`` on this rank (``dims``: its layout on
    the running process group; ``None``: one process, a group of 1 started if none runs)."""
    from qwen35_trainer.train.step import count_targets

    with process_group(device):
        built = trainer_step(recipe, device, dims)
        objective, layout = built.objective, built.layout
        data_s = statistics.median(built.feed.step(s)[1].seconds for s in range(1, 1 + REPEATS))
        valid, _ = count_targets(built.micro, layout, device)
        batch, packed = built.micro[0]

        def forward():
            return objective(batch, layout.loss_group, packed, num_valid_tokens=valid)

        def forward_backward():
            out = forward()
            getattr(out, "loss", out[0] if isinstance(out, tuple) else out).backward()

        seconds, calls = {}, {}
        for name, run in (("microbatch", forward_backward), ("forward", forward)):
            seconds[name], calls[name] = timed(run, device)
        seconds["step"], calls["step"] = timed(built.run, device, repeats=1)
    calls = {k: float(v) for k, v in calls.items()}
    grids = tuple(tuple(int(v) for v in g) for g in (*batch.image_grid_thw, *batch.video_grid_thw))
    return Probe(seconds, calls, data_s, len(built.micro), objective.model.config, grids)
