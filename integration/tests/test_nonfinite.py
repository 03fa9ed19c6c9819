"""A step whose loss or gradient norm is not finite is never applied: its weights and optimizer
state stay those of the step before; ``stop`` ends the run naming the step and its documents
(exit 1, newest checkpoint intact), ``skip`` drops the step and goes on."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import demo_recipe, media_document, nan_pixels, tiny

from qwen35_trainer import train
from qwen35_trainer.cli import main
from qwen35_trainer.data.feed import micro_batches
from qwen35_trainer.demo.dataset import make_demo
from qwen35_trainer.parallel import Layout
from qwen35_trainer.supervise.run_folder import step_records
from qwen35_trainer.train.integrity import INTACT, verify
from qwen35_trainer.train.nonfinite import NonFiniteStep
from qwen35_trainer.train.resume import checkpoints_in
from qwen35_trainer.train.step import train_step

DATA = ("data.global_batch=2", "data.pack_length=128", "train.eval_every=0")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("demo"), train_rows=40, heldout_rows=8)


@pytest.fixture(scope="module")
def poisoned(demo):
    """A document of step 3 (one with media), and the state after step 2 of the clean run."""
    source = media_document(demo_recipe(demo, *DATA), step=3)
    with train(demo_recipe(demo, *DATA, "train.steps=2")) as after_two:
        return source, after_two.state_dict()


def _local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def _snapshot(objective, optimizer):
    params = {k: _local(v).clone() for k, v in objective.state_dict().items()}
    moments = [
        (k, _local(v).clone()) for state in optimizer.state.values() for k, v in state.items()
    ]
    return params, moments


def _same(a, b) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a[0].values(), b[0].values(), strict=True)
    ) and all(k == j and torch.equal(x, y) for (k, x), (j, y) in zip(a[1], b[1], strict=True))


def test_a_nonfinite_step_changes_no_weight_and_no_optimizer_state():
    recipe = tiny("train.steps=1")
    run = train(recipe)
    objective, optimizer = run.objective, run.optimizer
    before = _snapshot(objective, optimizer)
    micro, _ = micro_batches(recipe, objective.model.config, Layout(), 1, torch.device("cpu"))
    micro[0][0].pixel_values.fill_(float("nan"))
    step = dict(aux_coef=1e-3, grad_clip=1.0, device=torch.device("cpu"))
    result = train_step(objective, optimizer, micro, Layout(), **step)
    assert not result.applied and math.isnan(result.grad_norm) and math.isnan(result.ce)
    assert _same(_snapshot(objective, optimizer), before)
    assert all(p.grad is None for p in objective.parameters())
    micro, _ = micro_batches(recipe, objective.model.config, Layout(), 1, torch.device("cpu"))
    assert train_step(objective, optimizer, micro, Layout(), **step).applied
    assert not _same(_snapshot(objective, optimizer), before)  # a finite step does change them


def test_stop_names_the_step_and_its_documents_and_keeps_the_weights(demo, poisoned):
    source, after_two = poisoned
    with nan_pixels(source), pytest.raises(NonFiniteStep) as caught:
        train(demo_recipe(demo, *DATA, "train.steps=5"))
    message = str(caught.value)
    assert message.startswith("step 3: loss nan, gradient norm nan; the update was not applied")
    assert source in message and caught.value.sources.count(source) == 1
    assert [log.step for log in caught.value.result.logs] == [1, 2, 3]
    state, reference = caught.value.result.state_dict(), after_two
    assert all(torch.equal(value, reference[name]) for name, value in state.items())


def test_stop_exits_1_and_the_newest_checkpoint_is_intact(demo, poisoned, tmp_path, capsys):
    source, _ = poisoned
    sets = [
        *DATA,
        f"data.path={demo}/train.jsonl",
        f"data.processor={demo}/processor",
        f"data.eval_path={demo}/heldout.jsonl",
        "data.workers=0",
        "parallel.dp=1",
        "parallel.cp=1",
        "parallel.ep=1",
        "train.steps=5",
        "train.checkpoint_every=1",
        f"train.output_dir={tmp_path}",
    ]
    with nan_pixels(source):
        assert main(["tiny", *(a for s in sets for a in ("--set", s))]) == 1
    err = capsys.readouterr().err
    assert err.count("qwen35-train: step 3: loss nan") == 1 and source in err, err
    records = step_records(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"] is None) for r in records] == [(1, False), (2, False), (3, True)]
    newest = checkpoints_in(tmp_path / "checkpoints")[0]
    assert newest[0] == 2 and verify(newest[1]).state == INTACT


def test_skip_drops_the_step_and_goes_on(demo, poisoned, caplog):
    source, _ = poisoned
    with nan_pixels(source), caplog.at_level("WARNING", logger="qwen35_trainer"):
        logs = train(demo_recipe(demo, *DATA, "train.steps=5", "train.on_nonfinite=skip")).logs
    assert [math.isfinite(log.loss) for log in logs] == [True, True, False, True, True]
    assert [log.skipped_steps for log in logs] == [0, 0, 1, 1, 1]
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped:")]
    assert len(skipped) == 1 and "step 3: loss nan" in skipped[0] and source in skipped[0]
    with nan_pixels(source), pytest.raises(NonFiniteStep, match=r"max_skipped_steps=1 skipped"):
        train(
            demo_recipe(
                demo, *DATA, "train.steps=5", "train.on_nonfinite=skip", "train.max_skipped_steps=1"
            )
        )
