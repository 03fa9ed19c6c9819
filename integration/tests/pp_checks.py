"""Pipeline-parallel checks run on every rank of test_train_dp.py's gloo launches: each rank
holds its stages' parameters only, so the final state is compared name by name with the
one-process run's, and the ranks' names together must be all of them."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from dist_checks import FIELDS, STEPS, assert_same_run, layout_recipe

from dist_testkit import assert_close
from qwen35_trainer import train

__all__ = [
    "check_padding_not_computed",
    "check_pipeline_equals_one_process",
    "check_pipeline_eval_and_export",
    "pp_export_equals_one_process",
    "pp_resume_in_one_process",
]


def check_pipeline_equals_one_process(
    overrides, reference_logs, reference_state, compare=None, resume_dir=None, from_one=None
) -> None:
    """The PP layout ``overrides`` equals one process over 3 steps (losses, gradient norms, every
    parameter). With ``resume_dir``: also stopped after step 1 and resumed at the same layout;
    with ``from_one``: also resumed from the ONE-process step-1 checkpoint in that folder (its
    stages' parameters and Adam state read by name): both equal the uninterrupted run."""
    world = dist.get_world_size()
    compare = compare or {}
    result = train(layout_recipe(world, *overrides))
    assert_stage_state(result, reference_logs, reference_state, compare)
    later = reference_logs[1:]
    if resume_dir is not None:
        stop = (*overrides, f"train.checkpoint_dir={resume_dir}")
        train(layout_recipe(world, *stop, "train.steps=1"))
        assert_stage_state(train(layout_recipe(world, *stop)), later, reference_state, compare)
    if from_one is not None:
        copy = Path(f"{from_one}_pp{world}")
        if dist.get_rank() == 0:  # the resumed run writes its own checkpoints beside it
            shutil.copytree(Path(from_one) / "step_000001", copy / "step_000001")
        dist.barrier()
        resumed = train(layout_recipe(world, *overrides, f"train.checkpoint_dir={copy}"))
        assert_stage_state(resumed, later, reference_state, compare)


def assert_stage_state(result, reference_logs, reference_state, compare) -> None:
    """:func:`assert_same_run` on this rank's parameters; the ranks' names cover the model."""
    state = result.objective.model.state_dict()
    assert_same_run(
        result.logs,
        reference_logs,
        state,
        {name: reference_state[name] for name in state},
        **compare,
    )
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(state))
    held = set().union(*map(set, names))
    assert held == set(reference_state), sorted(held ^ set(reference_state))


def pp_resume_in_one_process(saved: Path, tmp: Path, variant, reference, compare=None) -> None:
    """The step-1 checkpoint a PP run wrote, resumed by ONE process: steps 2..3 and the final
    parameters equal the uninterrupted run."""
    shutil.copytree(saved / "step_000001", tmp / "step_000001")
    result = train(layout_recipe(1, *variant, f"train.checkpoint_dir={tmp}"))
    fields = (compare or {}).get("fields", FIELDS)
    state = result.objective.model.state_dict()
    assert_same_run(result.logs, reference[0][1:], state, reference[1], fields=fields)


def pp_export_equals_one_process(saved: Path, one: Path, tmp: Path, variant) -> None:
    """``qwen35-train export`` of the PP run's step-1 checkpoint and of one process's: the same
    tensor names, and values within the runs' tolerance (the PP ranks add in another order)."""
    from safetensors.torch import load_file

    from qwen35_trainer.train.export import export_checkpoint

    tensors = []
    for name, folder in (("pp", saved), ("one", one)):
        recipe = layout_recipe(1, *variant)
        export_checkpoint(recipe, folder / "step_000001", tmp / name)
        files = sorted((tmp / name).glob("*.safetensors"))
        tensors.append({k: v for f in files for k, v in load_file(f).items()})
    ours, reference = tensors
    assert sorted(ours) == sorted(reference)
    lr = layout_recipe(1).train.lr
    for name, value in reference.items():
        assert_close(ours[name].float(), value.float(), rtol=1e-4, atol=1e-3 * lr, name=name)


def check_pipeline_eval_and_export(
    overrides, reference_logs, reference_state, compare, folder
) -> None:
    """The PP layout ``overrides`` with a held-out evaluation every step and
    ``train.export_dir``: the logs — the held-out loss and accuracies included — and the
    parameters equal one process's (that evaluates the same weights at pp=1); the export the
    stages wrote equals ``qwen35-train export`` of the run's last checkpoint, tensor for tensor
    and bit for bit (the merged model, or a LoRA run's PEFT adapter folder), its configs the
    same."""
    from qwen35_trainer.train.export import export_checkpoint

    world, root = dist.get_world_size(), Path(folder)
    run = (*overrides, f"train.checkpoint_dir={root}/ckpt", f"train.export_dir={root}/export")
    result = train(layout_recipe(world, *run))
    assert result.logs[-1].eval_loss is not None
    assert_stage_state(result, reference_logs, reference_state, compare)
    last = root / "ckpt" / f"step_{STEPS:06d}"
    export_checkpoint(layout_recipe(world, *overrides), last, root / "from_checkpoint")
    if dist.get_rank() == 0:
        assert_same_folder(root / "export", root / "from_checkpoint")
    dist.barrier()


def assert_same_folder(ours: Path, reference: Path) -> None:
    """Two exports hold the same tensors (names, dtypes, values bit for bit) and configs."""
    import json

    from safetensors.torch import load_file

    tensors = [
        {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
        for folder in (ours, reference)
    ]
    assert sorted(tensors[0]) == sorted(tensors[1])
    for name, value in tensors[1].items():
        assert tensors[0][name].dtype == value.dtype, name
        assert torch.equal(tensors[0][name], value), name
    for config in ("config.json", "adapter_config.json"):
        if (reference / config).is_file():
            loaded = [json.loads((f / config).read_text()) for f in (ours, reference)]
            assert loaded[0] == loaded[1], config


def check_padding_not_computed(overrides) -> None:
    """Under PP each stage's layers run the micro-batch row's own tokens, not the padding of
    the P2P buffers: every call of a stage's layers sees this rank's tokens of the row
    (``layout.local_len``), fewer than the buffer holds when the row is not full."""
    from qwen35_trainer.model.pipeline.stages import StageModule

    seen, layers = [], StageModule._layers

    def recording(self, hidden_BTH, packed, rank):
        seen.append((hidden_BTH.shape[1], packed.layout.local_len(rank), self.buffer_tokens))
        return layers(self, hidden_BTH, packed, rank)

    StageModule._layers = recording
    try:
        train(layout_recipe(dist.get_world_size(), *overrides, "train.steps=1"))
    finally:
        StageModule._layers = layers
    assert seen and all(tokens == row for tokens, row, _ in seen), seen
    assert any(tokens < buffer for tokens, _, buffer in seen), seen
