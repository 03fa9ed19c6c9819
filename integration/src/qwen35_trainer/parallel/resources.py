"""What a run creates in this process, released when it ends: its process groups (every mesh's,
the background checkpointer's), the one-rank default group a lone process makes, and its
sharded model's hold on them.

Why it matters: each gloo group keeps three threads (two workers and a TCP loop that wakes
while idle), so a process that runs several trainings (a notebook, a sweep, the test suite's
launches, ``replay`` after a run) without releasing them ran among thousands of threads: 1,200
per rank and a load average of 73 on 2 cores in one test launch. Destroying a group is not
enough: FSDP2's units keep their groups, and a model that ran is not always freed with its last
reference (:func:`fsdp_compat.release` detaches both).

A run opens a :class:`RunResources` before it makes any group (:func:`open_run`) and releases
it when it ends: at once when it fails; on success when its result is closed
(:meth:`qwen35_trainer.train.TrainResult.close`, or ``with train(recipe) as result:``), its
model's DTensors being usable until then; or, when the caller has dropped the result without
closing it, when the next run in the process opens. A result the caller still holds keeps its
run (two results compared after both runs stay usable). Every rank of a launch opens and
releases the same runs in the same order (a result is dropped at the same point of the same
program on every rank), and destroys the same groups, newest first.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from fsdp_compat import release

__all__ = ["RunResources", "live_groups", "open_run"]

# the runs of this process not released yet, oldest first
_open: list[RunResources] = []


def live_groups() -> list[dist.ProcessGroup]:
    """Every process group of this process that is not destroyed, oldest first."""
    world = dist.distributed_c10d._world  # torch's own registry (no public listing exists)
    return sorted(world.pg_map, key=lambda group: world.pg_names[group])


class RunResources:
    """The groups created since this run opened, the default group when this run made a
    one-rank one, and the models to release with them."""

    def __init__(self) -> None:
        self.earlier = set(live_groups())
        self.owns_default = not dist.is_initialized()
        self.models: list[nn.Module] = []
        self.forget: list[Callable[[], None]] = []
        self.released = False
        self.result: weakref.ref | None = None  # the run's result, once it has one

    def hold(self, model: nn.Module, forget: Callable[[], None] | None = None) -> None:
        """Release ``model`` (:func:`fsdp_compat.release`) with the run, calling ``forget``
        first (what the model keeps of its last forward)."""
        self.models.append(model)
        if forget is not None:
            self.forget.append(forget)

    def release(self) -> None:
        """Release the models, destroy the run's groups, newest first (every rank alike), and
        the default group when this run made it for one process. Idempotent."""
        if self.released:
            return
        self.released = True
        if self in _open:
            _open.remove(self)
        for forget in self.forget:
            forget()
        for model in self.models:
            release(model)
        self.models.clear()
        self.forget.clear()
        default = dist.GroupMember.WORLD if dist.is_initialized() else None
        for group in reversed(live_groups()):
            if group not in self.earlier and group is not default:
                dist.destroy_process_group(group)
        if self.owns_default and default is not None and dist.get_world_size() == 1:
            dist.destroy_process_group()
        gc.collect()  # FSDP2's released models are freed now, their backends' threads with them


def open_run() -> RunResources:
    """A new run's resources, after releasing every earlier run of this process whose result
    is gone (dropped without being closed) or that never had one."""
    for earlier in list(_open):
        if earlier.result is None or earlier.result() is None:
            earlier.release()
    _open.append(RunResources())
    return _open[-1]
