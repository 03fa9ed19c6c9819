"""What a step really allocates (:mod:`qwen35_trainer.plan.memory_probe`): the CPU allocator's
peak seen between ops against tensors of known sizes, and one process's step of the tiny
recipe against the planner's count of the same process (its persistent bytes exactly)."""

from __future__ import annotations

import torch
from helpers import ONE_PROCESS, SYNTHETIC

from qwen35_trainer import load_recipe
from qwen35_trainer.plan import plan
from qwen35_trainer.plan.memory_probe import MallocPeak, malloc_in_use, measure_peak

MIB = 1 << 20


def test_the_cpu_peak_is_the_tensors_alive_at_once_within_a_block():
    """Two 32 MiB tensors alive together, then freed, then a 4 MiB one: the peak is 64 MiB
    above the start (within 2 MiB of malloc's own bookkeeping and Python's objects), although
    neither is alive when the block ends."""

    def work():
        first = torch.ones(8 * MIB)  # 32 MiB of fp32
        second = first * 2
        del first, second
        torch.ones(MIB)

    start = malloc_in_use()
    mode = MallocPeak()
    with mode:
        work()
    assert 64 * MIB <= mode.peak - start < 66 * MIB
    assert malloc_in_use() - start < 2 * MIB  # all of it given back


def test_one_process_step_of_tiny_against_the_planners_count():
    """The tiny recipe in one process (synthetic rows of a fixed shape, checkpointing on): the
    step starts and ends with the parameters and AdamW's state, which the planner counts
    exactly (plus the model's buffers, which it does not: under 1 %); at its peak it also holds
    the gradients and the step's activations, at least what the planner counts for them."""
    fixed = ("data.text_tokens=[24, 24]", "data.image_grids=[[1, 8, 8]]")
    recipe = load_recipe("tiny", [*SYNTHETIC, *ONE_PROCESS, *fixed], hub_weights=False)
    counted = plan(recipe).ranks[0]
    peak = measure_peak(recipe, torch.device("cpu"))
    persistent = counted.parameters + counted.optimizer
    assert persistent <= peak.persistent < 1.01 * persistent
    assert peak.reserved is None and peak.fragmentation is None
    assert peak.allocated >= peak.persistent + counted.gradients + counted.activations
