"""The built-in demo dataset: ``qwen35-train data make-demo`` / ``data check``, and the tiny
recipe really learning from it (shortened: one process, 40 steps)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
from helpers import ONE_PROCESS

from qwen35_trainer import load_recipe, train
from qwen35_trainer.cli import main
from qwen35_trainer.data.conversation import ConversationEncoder, TokenIds
from qwen35_trainer.data.packing import pack
from qwen35_trainer.demo.dataset import make_demo
from qwen35_trainer.model import build_config
from qwen35_trainer.model.packed import packed_hidden_states


def test_make_demo_and_check(tmp_path, capsys):
    assert (
        main(["data", "make-demo", str(tmp_path), "--train-rows", "30", "--heldout-rows", "6"]) == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and all("messages" in r for r in rows)
    kinds = {
        p["type"]
        for r in rows
        for t in r["messages"]
        if isinstance(t["content"], list)
        for p in t["content"]
    }
    assert kinds == {"text", "image", "video"}
    assert any(
        isinstance(p.get("path"), str) and p["path"].endswith(".mp4")
        for r in rows
        for t in r["messages"]
        if isinstance(t["content"], list)
        for p in t["content"]
    )
    sets = [f"data.path={tmp_path}/train.jsonl", f"data.processor={tmp_path}/processor"]
    capsys.readouterr()
    assert main(["data", "check", "tiny", *(a for s in sets for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    assert "samples     30 good, 0 bad" in out and "packed rows" in out and "fill" in out
    with open(tmp_path / "train.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "image", "path": "images/gone.png"}]},
                        {"role": "assistant", "content": "red"},
                    ]
                }
            )
            + "\n"
        )
    assert main(["data", "check", "tiny", *(a for s in sets for a in ("--set", s))]) == 3
    out = capsys.readouterr().out
    assert "bad row     " in out and "train.jsonl:31: missing media file" in out


def test_documented_rows_encode(tmp_path):
    """The example rows of ``docs/data.md`` (its ``jsonl`` block) are valid rows of the demo's
    files."""
    readme = (Path(__file__).parents[1] / "docs" / "data.md").read_text()
    block = readme.split("```jsonl\n", 1)[1].split("```", 1)[0]
    root = make_demo(tmp_path, train_rows=4, heldout_rows=1)
    recipe = load_recipe("tiny")
    ids = TokenIds(
        recipe.model.image_token_id,
        recipe.model.video_token_id,
        recipe.model.vision_start_token_id,
        recipe.model.vision_end_token_id,
    )
    encoder = ConversationEncoder(str(root / "processor"), ids, build_config(recipe.model))
    samples = [
        encoder(json.loads(line), f"data.md:{i}", root) for i, line in enumerate(block.splitlines())
    ]
    assert [len(s.image_grid_thw) for s in samples] == [1, 0, 0]
    assert [len(s.video_grid_thw) for s in samples] == [0, 1, 0]


def _answer_accuracy(objective, recipe, root) -> dict[str, float]:
    """The trained model's held-out answers, teacher-forced arg-max on every token of each
    answer before its <|im_end|>: the share of answer TOKENS predicted right, and of whole
    answers; and what a model that ignores the pictures, videos and questions could reach —
    for tokens, the most frequent token at each offset of the answers (the best fixed answer
    template), for answers, the most frequent answer."""
    model = objective.model
    ids = TokenIds(
        recipe.model.image_token_id,
        recipe.model.video_token_id,
        recipe.model.vision_start_token_id,
        recipe.model.vision_end_token_id,
    )
    encoder = ConversationEncoder(str(root / "processor"), ids, model.config)
    end = encoder.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    right, tokens_right, answers = 0, 0, collections.Counter()
    with torch.no_grad():
        for i, line in enumerate((root / "heldout.jsonl").read_text().splitlines()):
            sample = encoder(json.loads(line), f"heldout.jsonl:{i}", root)
            batch, packed = pack([sample], model.config, pad_token_id=0)
            hidden, labels, *_ = packed_hidden_states(model.model, batch, packed)
            labels = labels[0]
            guess = (hidden[0] @ model.lm_head.weight.T).argmax(-1)
            at = 0
            while at < len(labels):
                if labels[at] == -100 or (at and labels[at - 1] != -100):
                    at += 1
                    continue
                stop = at + int((labels[at:] == end).nonzero()[0])  # the answer: up to <|im_end|>
                hits = guess[at:stop] == labels[at:stop]
                right += bool(hits.all())
                tokens_right += int(hits.sum())
                answers[tuple(labels[at:stop].tolist())] += 1
                at = stop
    at_offset = collections.defaultdict(collections.Counter)
    for answer, count in answers.items():
        for k, token in enumerate(answer):
            at_offset[k][token] += count
    tokens = sum(len(a) * c for a, c in answers.items())
    total = sum(answers.values())
    return {
        "tokens": tokens_right / tokens,
        "fixed_template": sum(max(c.values()) for c in at_offset.values()) / tokens,
        "answers": right / total,
        "majority": max(answers.values()) / total,
    }


def test_tiny_recipe_learns_the_demo_dataset(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN35_DEMO_DIR", str(tmp_path / "demo"))
    recipe = load_recipe(
        "tiny",
        [
            *ONE_PROCESS,
            "train.steps=40",
            "train.eval_every=40",
            "train.eval_steps=4",
            "data.workers=1",
        ],
    )
    result = train(recipe)
    logs = result.logs
    assert (tmp_path / "demo" / "demo.json").is_file()  # builtin:demo was written on first use
    first, last = logs[0], logs[-1]
    assert last.eval_loss < 0.5 * first.ce, (first.ce, last.eval_loss)
    acc = _answer_accuracy(result.objective, recipe, tmp_path / "demo")
    print(
        f"held-out loss {first.ce:.3f} -> {last.eval_loss:.3f}; label accuracy "
        f"{last.eval_accuracy:.3f}; answer tokens {acc['tokens']:.3f} (best fixed answer "
        f"template {acc['fixed_template']:.3f}); whole answers {acc['answers']:.3f} (most "
        f"frequent answer {acc['majority']:.3f})"
    )
    # answer tokens: measured 0.704 against 0.351 for the best fixed template (2026-12-02). Whole
    # answers are not asserted: 40 steps at lr 0.01 amplify tiny numerical differences between
    # machines and runs into 0.17-0.31 exact answers (0.129 for the most frequent one)
    assert acc["tokens"] > 1.5 * acc["fixed_template"], acc
    assert all(log.fill > 0.7 for log in logs)


@pytest.mark.parametrize("args", [["data"], ["data", "check"]])
def test_data_command_usage(args, capsys):
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2


def test_the_demo_tokenizer_splits_alike_beside_a_qwen35_config(demo, tmp_path):
    """transformers loads a tokenizer beside a Qwen3.5 ``config.json`` as ``Qwen3_5Tokenizer``,
    which rebuilds Qwen's text pipeline around the vocabulary whatever class the tokenizer
    names: the demo's tokenizer has that pipeline, so both load it to the same ids and text
    comes back as it was (with its own Metaspace pipeline every space was dropped)."""
    import shutil

    from transformers import AutoProcessor

    from qwen35_trainer.model import build_config as config_of
    from qwen35_trainer.recipe import load_recipe as recipe_of

    beside = tmp_path / "beside"
    shutil.copytree(demo / "processor", beside)
    config_of(recipe_of("tiny").model).save_pretrained(beside)
    text = "what colour is the shape? <1.5 seconds>\nred"
    alone = AutoProcessor.from_pretrained(demo / "processor").tokenizer
    qwen = AutoProcessor.from_pretrained(beside).tokenizer
    assert type(qwen).__name__ == "Qwen3_5Tokenizer"
    assert qwen(text)["input_ids"] == alone(text)["input_ids"]
    assert qwen.decode(qwen(text)["input_ids"]) == text
