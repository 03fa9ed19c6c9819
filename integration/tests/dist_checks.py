"""Checks run on every rank of a gloo launch (see test_train_dp.py)."""

from __future__ import annotations

import torch.distributed as dist
from helpers import tiny

from dist_testkit import assert_close, full
from qwen35_trainer import train

STEPS = 3
GLOBAL_SAMPLES = 4


def layout_recipe(world: int, *overrides: str):
    """``world`` ranks, each with GLOBAL_SAMPLES / world rows of the same global batch."""
    return tiny(
        f"parallel.dp={world}",
        f"data.samples_per_rank={GLOBAL_SAMPLES // world}",
        f"train.steps={STEPS}",
        "model.expert_backend=torch",
        *overrides,
    )


def check_training_equals_one_process(overrides, reference_logs, reference_state) -> None:
    """The layout ``overrides`` over every rank: each step's global loss, CE, aux loss, gradient
    norm and token count, and the parameters after the last step, equal one process on the
    global batch."""
    result = train(layout_recipe(dist.get_world_size(), *overrides))
    for ours, ref in zip(result.logs, reference_logs, strict=True):
        assert ours.tokens == ref.tokens, (ours, ref)
        for field in ("loss", "ce", "aux", "grad_norm"):
            assert abs(getattr(ours, field) - getattr(ref, field)) <= 1e-5 * (
                1 + abs(getattr(ref, field))
            ), (field, ours, ref)
    # AdamW normalises each element's update, so fp32 round-off in a near-zero gradient moves
    # that element by up to a fraction of lr; a wrong gradient scale (which AdamW would hide)
    # is caught by the per-step gradient norms above.
    lr = layout_recipe(1).train.lr
    state = result.objective.model.state_dict()
    assert list(state) == list(reference_state)
    for name, value in state.items():
        assert_close(full(value), reference_state[name], rtol=1e-4, atol=1e-2 * lr, name=name)
