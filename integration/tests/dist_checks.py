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
        "data.packing=false",
        "train.eps=0.001",
        *overrides,
    )


FIELDS = ("loss", "ce", "aux", "grad_norm")


def assert_same_run(logs, reference_logs, state, reference_state, *, fields=FIELDS, rel=1e-5,
                    param_rtol=1e-4, param_norm_rel=None) -> None:  # fmt: skip
    """Per step: global loss, CE, aux loss, gradient norm (rel ``rel``) and token count; then
    the final parameters (gathered when sharded): elementwise, or with ``param_norm_rel`` by
    each tensor's relative distance."""
    for ours, ref in zip(logs, reference_logs, strict=True):
        assert (ours.step, ours.tokens) == (ref.step, ref.tokens), (ours, ref)
        for field in fields:
            assert abs(getattr(ours, field) - getattr(ref, field)) <= rel * (
                1 + abs(getattr(ref, field))
            ), (field, ours, ref)
    # AdamW divides by sqrt(v) + eps: with the default eps, fp32 round-off in a near-zero
    # gradient can move that element by up to lr per step, so these runs use eps = 1e-3 (a
    # smooth update); a wrong gradient scale, which Adam partly hides, is caught by the per-step
    # gradient norms above.
    lr = layout_recipe(1).train.lr
    assert list(state) == list(reference_state)
    for name, value in state.items():
        ours, ref = full(value).float(), reference_state[name]
        if param_norm_rel is None:
            assert_close(ours, ref, rtol=param_rtol, atol=1e-3 * lr, name=name)
        else:  # per tensor, Frobenius: |ours - ref| <= rel * (|ref| + |one Adam step|)
            gap, size = float((ours - ref).norm()), float(ref.norm()) + lr * ref.numel() ** 0.5
            assert gap <= param_norm_rel * size, (name, gap, size)


def check_training_equals_one_process(overrides, reference_logs, reference_state,
                                      compare=None) -> None:  # fmt: skip
    """The layout ``overrides`` over every rank equals one process on the global batch.
    ``compare``: :func:`assert_same_run` keyword arguments (fields, tolerances)."""
    result = train(layout_recipe(dist.get_world_size(), *overrides))
    state = result.objective.model.state_dict()
    assert_same_run(result.logs, reference_logs, state, reference_state, **(compare or {}))


def check_resume_equals_uninterrupted(overrides, path, reference_logs, reference_state) -> None:
    """Stop after 1 step (checkpoint), start again: steps 2..3 and the final parameters equal
    the uninterrupted one-process run."""
    world = dist.get_world_size()
    first = train(layout_recipe(world, *overrides, "train.steps=1", f"train.checkpoint_dir={path}"))
    assert [log.step for log in first.logs] == [1]
    result = train(layout_recipe(world, *overrides, f"train.checkpoint_dir={path}"))
    state = result.objective.model.state_dict()
    assert_same_run(result.logs, reference_logs[1:], state, reference_state)
