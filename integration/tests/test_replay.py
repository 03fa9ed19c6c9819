"""``qwen35-train replay``: a step recomputed from the checkpoint before it reproduces the
logged loss and gradient norm bit for bit, its per-layer gradient norms make up the total, and
it names the documents the run read at that step."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ONE_PROCESS

from qwen35_trainer.cli import main
from qwen35_trainer.data.loader import DataStream
from qwen35_trainer.model import build_config
from qwen35_trainer.parallel import Layout
from qwen35_trainer.recipe import load_recipe
from qwen35_trainer.supervise.run_folder import step_records
from qwen35_trainer.train.replay import replay

RUN = (
    *ONE_PROCESS,
    "data.global_batch=2",
    "data.pack_length=128",
    "train.eval_every=2",
    "train.steps=5",
    "data.workers=0",
)


def _sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny recipe on its demo dataset, one process, 5 steps, a checkpoint after step 2;
    held-out evaluation every 2 steps (it must not disturb the replay)."""
    out = tmp_path_factory.mktemp("run")
    assert main(["tiny", *_sets(*RUN, "train.checkpoint_every=2", f"train.output_dir={out}")]) == 0
    records = step_records(out / "metrics.jsonl")
    return out, {r["step"]: r for r in records}


@pytest.mark.parametrize("step", [3, 5])
def test_replay_reproduces_the_logged_step(run, step, capsys):
    out, logged = run
    capsys.readouterr()
    assert (
        main(["replay", "tiny", str(out / "checkpoints"), "--step", str(step), *_sets(*RUN)]) == 0
    )
    text = capsys.readouterr().out
    checkpoint = out / "checkpoints" / ("step_000002" if step == 3 else "step_000004")
    assert text.startswith(f"replay of step {step} from {checkpoint}\n"), text
    record = logged[step]
    assert f"loss {record['loss']!r}  " in text and f"grad_norm {record['grad_norm']!r}  " in text
    assert "-> identical" in text


def test_layer_norms_and_documents(run):
    out, logged = run
    recipe = load_recipe("tiny", RUN)
    result = replay(recipe, out / "checkpoints" / "step_000002", 3)
    assert (result.loss, result.grad_norm) == (logged[3]["loss"], logged[3]["grad_norm"])
    norms = result.layer_norms
    assert {"lm_head", "model.language_model.layers.3", "model.visual.blocks.1"} <= set(norms)
    total = math.sqrt(sum(n * n for n in norms.values()))
    assert math.isclose(total, result.grad_norm, rel_tol=1e-5), (total, result.grad_norm)
    stream = DataStream(recipe, build_config(recipe.model), Layout(), torch.device("cpu"))
    steps = [stream.next_step() for _ in range(3)]
    assert result.sources == [doc.source for row in steps[2].rows for doc in row]


def test_replay_refuses_a_step_it_cannot_reach(run, capsys):
    out, _ = run
    checkpoint = out / "checkpoints" / "step_000004"
    assert main(["replay", "tiny", str(checkpoint), "--step", "2", *_sets(*RUN)]) == 2
    assert "holds the state after step 4: it can replay steps 5..5" in capsys.readouterr().err
