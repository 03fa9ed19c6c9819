"""The trained model as a folder a server or ``from_pretrained`` loads as it is: ``qwen35-train
export`` (a training checkpoint) and ``train.export_dir`` (the end of a run).

The folder mirrors the source checkpoint (``model.path`` / ``model.weights``): its routed
experts in the source's layout (per expert or stacked, :func:`~qwen35_trainer.model.adapter.
expert_layout`; ``experts`` overrides), its ``dtype`` (``model.stored_dtype``, read from
``config.json`` once, with the recipe; ``dtype`` overrides, else the trained weights' own),
``config.json`` with ``architectures`` and ``dtype``, and beside the weights the source's
processor — tokenizer, chat template, image and video processors (``model.path``, else
``data.processor``), their files copied byte for byte (:data:`PROCESSOR_FILES`) — and a ``generation_config.json`` whose eos and pad ids stop
``generate`` at the end of an assistant turn (``<|im_end|>``; the source's file completed:
:mod:`qwen35_trainer.train.generation_config`). A recipe without a processor gets the weights
only, and the notes say so. The weight files get the mode the folder's other files get
(:mod:`qwen35_trainer.model.weights.saving`), so a server running as another user reads them.

A LoRA run (``model.lora``) exports its adapters by default (``lora``: ``peft``, PEFT's
``target_parameters`` layout for the experts; ``per_expert``, 2-D adapters per expert;
:mod:`qwen35_trainer.model.lora.peft_export`) with ``base_model_name_or_path`` naming the base
checkpoint, or with ``merged`` the merged weights as a whole checkpoint folder.

A folder that is not empty is refused (it may hold another checkpoint's weights, which
``from_pretrained`` would load instead of the new ones: a lone ``model.safetensors`` is read
before an index). With ``overwrite`` the weight files it holds — ``*.safetensors``, their
index, ``pytorch_model*.bin`` and theirs — are removed first (and named in the notes); its
other files stay. Every rank checks the folder and the ranks agree before anyone writes.

``checkpoint`` is one ``step_NNNNNN`` directory (verified against its manifest: a damaged one is
an error) or a checkpoint directory (its newest intact checkpoint is taken). The recipe gives the
model; its layout does not matter: the weights are re-sharded by DCP onto this launch (one
process, or FSDP over every rank under ``torchrun``, each holding 1/N), then written without
gathering (:func:`qwen35_trainer.model.export_hf`).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compat import full_tensor
from qwen35_trainer.model import build_training_model, export_hf
from qwen35_trainer.model.lora.peft_export import LORA_FORMATS, saved_modules, write_adapter
from qwen35_trainer.model.weights.adapter import expert_layout
from qwen35_trainer.model.weights.export import FP8Export
from qwen35_trainer.model.weights.files import open_files
from qwen35_trainer.model.weights.stored import SCALE_SUFFIX
from qwen35_trainer.parallel.dist import any_rank, device, init_distributed, rank, world
from qwen35_trainer.parallel.resources import RunResources, open_run
from qwen35_trainer.recipe import ParallelRecipe, Recipe
from qwen35_trainer.recipe.hub import PROCESSOR_FILES  # a processor folder's files
from qwen35_trainer.train.generation_config import GENERATION_CONFIG, write_generation_config
from qwen35_trainer.train.integrity import MANIFEST
from qwen35_trainer.train.resume import checkpoints_in, load_model_weights, newest_loadable

__all__ = [
    "EXPERT_LAYOUTS",
    "ExportOptions",
    "check_export_dir",
    "export_checkpoint",
    "export_model",
    "resolve_checkpoint",
]

logger = logging.getLogger("qwen35_trainer")

EXPERT_LAYOUTS = ("source", "stacked", "per_expert")
DTYPES = ("float32", "bfloat16", "float16", "fp8")
# what an FP8 export made from a bf16 checkpoint keeps in bf16 (as Qwen's FP8 releases do)
NOT_CONVERTED = ["lm_head", "model.language_model.embed_tokens", "model.visual", "mtp.fc"]
# what from_pretrained or a server could load as the folder's weights
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin*")


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """``overwrite``: replace the weights of a non-empty folder; ``experts``: ``source`` (the
    source checkpoint's layout, stacked without one), ``stacked`` or ``per_expert``;
    ``dtype``: the tensors' dtype on disk (``None``: the source's, else the weights'; ``fp8``:
    the weights Qwen's FP8 releases convert in block-scaled FP8, the rest in the source's
    dtype, bf16 without one);
    ``lora``: a LoRA run's format (``peft``, ``per_expert`` or ``merged``; ``None``: ``peft``);
    ``base``: the base an adapter export names (``None``: ``train.export_base``, else
    ``model.path`` as the recipe wrote it — a relative path stays relative)."""

    overwrite: bool = False
    experts: str = "source"
    dtype: str | None = None
    lora: str | None = None
    base: str | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and self.lora not in LORA_FORMATS:
            raise ValueError(f"lora must be one of {LORA_FORMATS}, got {self.lora!r}")
        if self.experts not in EXPERT_LAYOUTS:
            raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {self.experts!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")


def _refusal(out: Path, overwrite: bool) -> str | None:
    if out.exists() and not out.is_dir():
        return f"{out} is a file, not a folder"
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (f", … ({len(held)} entries)" if len(held) > 5 else "")
        return (
            f"{out} is not empty (it holds {shown}): an export is a whole checkpoint folder, "
            "and old weights beside the new ones can be loaded instead of them; choose a new "
            "folder, or overwrite (qwen35-train export --overwrite, train.export_overwrite: "
            "true) to remove the weights it holds first"
        )
    return None


def check_export_dir(out: str | Path, overwrite: bool) -> None:
    """``ValueError`` on every rank when any rank finds ``out`` unfit (module docstring)."""
    refusal = _refusal(Path(out), overwrite)
    if any_rank(refusal is not None):
        raise ValueError(refusal or f"export folder {out}: refused on another rank")


def _per_expert(recipe: Recipe, experts: str) -> bool:
    if experts != "source":
        return experts == "per_expert"
    source = recipe.model.weights_dir
    return bool(source) and expert_layout(open_files(source)) == "per_expert"


def _dtype(recipe: Recipe, dtype: str | None) -> torch.dtype | None:
    name = dtype if dtype != "fp8" else None
    name = name or recipe.model.stored_dtype
    if dtype == "fp8":
        name = name or "bfloat16"
    return getattr(torch, name) if name else None


def _fp8_export(recipe: Recipe) -> FP8Export:
    """The FP8 format of an export with ``dtype: fp8``: an FP8 source checkpoint's own (its
    blocks, its scales' dtype, its ``quantization_config``), else ``model.fp8_block`` with fp32
    scales."""
    model = recipe.model
    config = model.quantization
    scale_dtype = torch.float32
    if config is not None:
        files = open_files(model.weights_dir)
        scales = [k for k in files.where if k.endswith(SCALE_SUFFIX)]
        scale_dtype = torch.bfloat16 if scales and files.dtype(scales[0]) == "BF16" else scale_dtype
    else:
        config = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(model.block),
            "modules_to_not_convert": NOT_CONVERTED,
        }
    return FP8Export(tuple(model.block), scale_dtype, config)


def _processor_dir(recipe: Recipe) -> Path | None:
    """The first of ``model.path``, ``data.processor`` that holds a tokenizer."""
    for folder in (recipe.model.path, recipe.data.processor):
        tokenizer = ("tokenizer_config.json", "tokenizer.json")
        if folder and any((Path(folder) / name).is_file() for name in tokenizer):
            return Path(folder)
    return None


def _clear_weights(out: Path) -> list[str]:
    removed = sorted({p for pattern in WEIGHT_FILES for p in out.glob(pattern) if p.is_file()})
    for path in removed:
        path.unlink()
    return [p.name for p in removed]


def _beside_weights(recipe: Recipe, out: Path) -> list[str]:
    """Copy the source's processor, tokenizer and chat template into ``out``, byte for byte
    (a tool that reads them directly sees the source's files, not transformers' re-save of
    them), and write its generation config with the tokenizer's stop ids
    (:func:`~qwen35_trainer.train.generation_config.write_generation_config`); what was
    written."""
    folder = _processor_dir(recipe)
    if folder is None:
        return [
            "no processor, tokenizer or chat template written: the recipe names none "
            "(model.path or data.processor)"
        ]
    copied = [name for name in PROCESSOR_FILES if (folder / name).is_file()]
    for name in copied:
        shutil.copyfile(folder / name, out / name)
    notes = [f"copied byte for byte from {folder}: {', '.join(copied)}"]
    sources = (Path(recipe.model.path or folder), folder)
    source = next((s for s in sources if (s / GENERATION_CONFIG).is_file()), None)
    return notes + write_generation_config(folder, source, out)


def export_model(
    model: nn.Module,
    recipe: Recipe,
    out: str | Path,
    options: ExportOptions,
    pipeline_group: Any = None,
) -> list[str]:
    """Write ``model`` (trained from ``recipe``) to ``out``; every rank calls it (under
    pipeline parallelism each rank holding its stages, ``pipeline_group`` its pipeline group:
    each stage's ranks write its tensors, :func:`~qwen35_trainer.model.weights.export.
    export_hf`). Returns notes on what was written (rank 0's)."""
    out = Path(out)
    check_export_dir(out, options.overwrite)
    lora = recipe.model.lora
    if options.lora is not None and lora is None:
        raise ValueError(f"a LoRA export format ({options.lora}) for a recipe without model.lora")
    notes = []
    if rank() == 0 and out.is_dir():
        removed = _clear_weights(out)
        if removed:
            notes.append(f"removed the weights {out} held: {', '.join(removed)}")
    fmt = (options.lora or "peft") if lora is not None else "merged"
    if fmt != "merged":
        base = options.base or recipe.train.export_base or recipe.model.base_as_written
        per_expert = fmt == "per_expert"
        write_adapter(
            model,
            lora,
            out,
            full_tensor,
            per_expert=per_expert,
            base=base,
            writer=rank() == 0,
            pipeline=pipeline_group is not None,
        )
        notes.append(f"LoRA adapters ({fmt} layout, scales folded into B) for the base {base}")
        trained = getattr(model, "lora_trained", ())
        if trained:
            saved = saved_modules(model)
            notes.append(f"modules trained in full, as PEFT's modules_to_save: {len(saved)}")
            if len(saved) < len(trained):
                notes.append(
                    "the multi-token-prediction head's modules trained in full are in the "
                    "merged export only (--lora merged): PEFT's model has no MTP head"
                )
    else:
        per_expert, dtype = _per_expert(recipe, options.experts), _dtype(recipe, options.dtype)
        fp8 = _fp8_export(recipe) if options.dtype == "fp8" else None
        export_hf(
            model,
            out,
            per_expert=per_expert,
            dtype=dtype,
            fp8=fp8,
            pipeline_group=pipeline_group,
        )
        written = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
        if fp8 is not None:
            written = (
                f"FP8 e4m3 in blocks of {list(fp8.block)} with "
                f"{str(fp8.scale_dtype).removeprefix('torch.')} scales (the rest {written})"
            )
        layout = "per expert" if per_expert else "stacked"
        if options.experts == "source" and per_expert:
            layout += " (the source checkpoint's layout)"
        merged = ", LoRA adapters merged" if lora is not None else ""
        notes.append(f"weights in {written}, routed experts {layout}{merged}")
    if rank() == 0:
        notes += _beside_weights(recipe, out)
    if dist.is_initialized():
        dist.barrier()
    return notes


def resolve_checkpoint(path: Path) -> Path:
    """The newest loadable checkpoint when ``path`` holds ``step_NNNNNN`` directories (newer
    damaged ones skipped, each logged at WARNING), else ``path`` itself (verified when it is
    loaded); ``ValueError`` when it is neither."""
    if not checkpoints_in(path):
        if not any((path / name).exists() for name in (".metadata", MANIFEST)):
            raise ValueError(f"{path}: neither a checkpoint nor a directory holding one")
        return path
    found, damaged = newest_loadable(path)
    for message in damaged:
        logger.warning(message)
    return found


def export_checkpoint(
    recipe: Recipe, checkpoint: Path, out: Path, options: ExportOptions | None = None
) -> tuple[int, list[str]]:
    """Write ``checkpoint``'s model (:func:`resolve_checkpoint` already applied) to ``out``;
    returns its step and the notes of :func:`export_model`. Every rank of the launch calls
    it; what it creates (its groups, its model) is released before it returns."""
    resources = open_run()
    try:
        return _export_checkpoint(recipe, checkpoint, out, options or ExportOptions(), resources)
    finally:
        resources.release()


def _export_checkpoint(
    recipe: Recipe, checkpoint: Path, out: Path, options: ExportOptions, resources: RunResources
) -> tuple[int, list[str]]:
    init_distributed()  # torchrun's group, or one rank's
    check_export_dir(out, options.overwrite)  # before the weights are read
    # this launch's ranks as one FSDP group, fp32, the weights allocated (every value is then
    # read from the checkpoint)
    # (a LoRA checkpoint holds the adapters: the frozen base is read from its checkpoint)
    model = (
        recipe.model
        if recipe.model.lora
        else dataclasses.replace(recipe.model, weights=None, path=None)
    )
    built = dataclasses.replace(
        recipe,
        model=model,
        parallel=ParallelRecipe(dp=world()),
        train=dataclasses.replace(recipe.train, dtype="float32", activation_checkpointing=False),
    )
    objective, _ = build_training_model(built, device())
    resources.hold(objective, objective.router.clear)
    step = load_model_weights(checkpoint, objective)
    return step, export_model(objective.model, recipe, out, options)
