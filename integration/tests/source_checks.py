"""The folders of :mod:`source_matrix`'s sources, their one-process references, and the check
each rank of test_train_matrix.py's launches runs for a ``(layout, source)`` cell."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from dist_checks import assert_same_run, layout_recipe
from pp_checks import assert_stage_state
from source_matrix import COMPARE, MATRIX_LAYOUTS, MATRIX_SOURCES, ROWS

from fsdp_compat import full_tensor
from qwen35_trainer import train

__all__ = ["check_from_source", "matrix_folders", "matrix_references", "source_overrides"]


def _hf_folder(folder: Path):
    """The tiny recipe's model (no MTP head) as transformers' ``save_pretrained`` writes it, in
    bf16, from transformers' own initialisation; returns the model."""
    from helpers import tiny
    from transformers import Qwen3_5MoeForConditionalGeneration

    from qwen35_trainer.model import build_config

    torch.manual_seed(0)
    config = build_config(tiny("model.mtp_layers=0").model)
    model = Qwen3_5MoeForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return model


def _dcp_folder(model, folder: Path) -> Path:
    """``model``'s state dict (transformers' runtime names, the experts stacked) as a
    DCP-based trainer keeps its weights: ``torch.distributed.checkpoint.save`` in one process,
    no config beside it (the recipe gives it)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), checkpoint_id=str(folder), no_dist=True)
    return folder


def _export_folder(folder: Path) -> Path:
    """The seeded tiny model with its MTP head exported by this trainer in fp32: the experts
    stacked, files of at most 64 KiB with an index."""
    from helpers import tiny

    from qwen35_trainer import build_model
    from qwen35_trainer.model import export_hf

    recipe = tiny("model.mtp_layers=1", *ROWS)
    export_hf(build_model(recipe.model), folder, max_file_bytes=64 << 10)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def matrix_folders(root: Path, fp8: Path) -> dict[str, str]:
    """Every source's folder (``resume``: the parent of the one-process step-1 checkpoints,
    one per micro-batch count, ``{resume}/micro{M}``; ``adapter``: a PEFT adapter folder)."""
    transformers_model = _hf_folder(root / "hf")
    folders = {
        "hf": root / "hf",
        "dcp": _dcp_folder(transformers_model, root / "dcp"),
        "fp8": fp8,
        "export": _export_folder(root / "export"),
        "resume": root / "resume",
    }
    adapter = root / "adapter"  # a PEFT adapter folder: a one-step LoRA run's export
    lora = source_overrides("lora_init", {**folders, "adapter": ""}, 1)
    lora = tuple(o for o in lora if not o.startswith("model.lora.init_from="))
    train(layout_recipe(1, *lora, "train.steps=1", f"train.export_dir={adapter}"))
    folders["adapter"] = adapter
    for micro in (1, 2):
        source = source_overrides("resume", folders, micro)
        stopped = tuple(o for o in source if not o.startswith("train.checkpoint_dir="))
        checkpoint = folders["resume"] / f"micro{micro}"
        train(layout_recipe(1, *stopped, f"train.checkpoint_dir={checkpoint}", "train.steps=1"))
    return {k: str(v) for k, v in folders.items()}


def source_overrides(source: str, folders: dict, micro: int) -> tuple[str, ...]:
    """``source``'s overrides with its folder, the matrix's rows and ``micro`` micro-batches per
    step (``resume``: the checkpoint of that micro-batch count)."""
    fill = {**folders, "resume": f"{folders['resume']}/micro{micro}"}
    given = tuple(o.format(**fill) for o in MATRIX_SOURCES[source])
    return (*ROWS, f"train.grad_accum_steps={micro}", *given)


def _resumed_copy(overrides: tuple[str, ...], to: str) -> tuple[str, ...]:
    """``overrides`` with its checkpoint folder copied to ``to`` (rank 0 copies): a resumed run
    writes its own checkpoints beside the one it starts from."""
    (saved,) = [o.split("=", 1)[1] for o in overrides if o.startswith("train.checkpoint_dir=")]
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.copytree(Path(saved) / "step_000001", Path(to) / "step_000001")
    if dist.is_initialized():
        dist.barrier()
    kept = tuple(o for o in overrides if not o.startswith("train.checkpoint_dir="))
    return (*kept, f"train.checkpoint_dir={to}")


def matrix_references(folders: dict, root: Path) -> dict:
    """``(source, micro) -> (logs, fp32 state)``: one process started from each source."""
    out = {}
    for source in MATRIX_SOURCES:
        for micro in (1, 2):
            overrides = source_overrides(source, folders, micro)
            if source == "resume":
                overrides = _resumed_copy(overrides, str(root / f"reference_micro{micro}"))
            result = train(layout_recipe(1, *overrides))
            state = {k: v.detach().float().clone() for k, v in result.state_dict().items()}
            out[source, micro] = (result.logs, state)
    return out


def check_from_source(
    layout: str, source: str, folders: dict, reference, copy_to: str
) -> tuple[float, float]:
    """Cell ``(layout, source)`` on this launch's ranks equals one process from the same source
    (module docstring of :mod:`source_matrix`); ``copy_to``: this cell's checkpoint folder
    when it resumes. Returns the largest relative differences found: of the logged values,
    and of this rank's parameters (each tensor's distance over its norm)."""
    overrides, micro, _ = MATRIX_LAYOUTS[layout]
    given = source_overrides(source, folders, micro)
    if source == "resume":
        given = _resumed_copy(given, copy_to)
    result = train(layout_recipe(dist.get_world_size(), *given, *overrides))
    logs, state = reference
    ours = result.objective.model.state_dict()
    if any(o.startswith("parallel.pp=") for o in overrides):
        assert_stage_state(result, logs, state, COMPARE[source])
    else:
        assert_same_run(result.logs, logs, ours, state, **COMPARE[source])
    return _differences(result.logs, logs, ours, state, COMPARE[source]["fields"])


def _differences(logs, reference_logs, state, reference_state, fields) -> tuple[float, float]:
    """``(logged, parameters)``: the largest relative difference of the logged ``fields`` over
    the steps, and of a parameter tensor (distance over the reference's norm); every rank
    gathers its sharded tensors in the same order."""
    logged = 0.0
    for ours, ref in zip(logs, reference_logs, strict=True):
        for field in fields:
            mine, theirs = getattr(ours, field), getattr(ref, field)
            mine, theirs = (mine, theirs) if isinstance(theirs, tuple) else ((mine,), (theirs,))
            for a, b in zip(mine, theirs, strict=True):
                logged = max(logged, abs(a - b) / max(abs(b), 1e-12))
    params = 0.0
    for name, value in state.items():
        ours, ref = full_tensor(value).float(), reference_state[name]
        params = max(params, float((ours - ref).norm() / ref.norm().clamp(min=1e-12)))
    return logged, params


def check_dcp_reads_only_its_chunks(folder: str) -> list[int]:
    """A tensor saved by every rank of the launch (dim 0 sharded: one stored chunk per rank)
    is read by :class:`~qwen35_trainer.model.weights.dcp.DcpFiles` rows: a rank's own rows
    touch its own chunk only, rows across two chunks touch both; the values are the saved
    ones. Returns the chunks this rank's own rows touched."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from qwen35_trainer.model.weights.dcp import DcpFiles

    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.arange(4 * world * 3, dtype=torch.float32).reshape(4 * world, 3)
    mesh = init_device_mesh("cpu", (world,))
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, checkpoint_id=folder)
    touched: list[int] = []
    read_data = FileSystemReader.read_data

    def counting(self, plan, planner):
        touched.extend(int(item.storage_index.offset[0]) for item in plan.items)
        return read_data(self, plan, planner)

    FileSystemReader.read_data = counting
    try:
        files = DcpFiles(folder)
        mine = files.rows("w", 4 * rank, 4 * rank + 4)
        assert torch.equal(mine, full[4 * rank : 4 * rank + 4])
        assert touched == [4 * rank], touched
        assert torch.equal(files.rows("w", 2, 6), full[2:6])
        assert touched[1:] == [0, 4], touched
    finally:
        FileSystemReader.read_data = read_data
    return touched[:1]
