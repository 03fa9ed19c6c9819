"""Checkpoints in the format of Qwen's FP8 releases, written by the tests, and their
hand-dequantized copies — the independent references of the FP8 tests.

:func:`fp8_checkpoint`: the tiny recipe's model (with its multi-token-prediction head, name-
seeded) exported per expert, then every projection Qwen's releases convert — attention
``q/k/v/o_proj``, the Gated DeltaNet's ``in_proj_qkv`` / ``in_proj_z`` / ``out_proj``, the
shared expert's and each expert's ``gate/up/down_proj``, in the decoder and the MTP layer —
rewritten as float8_e4m3fn with a bf16 ``weight_scale_inv`` per block, by a block-by-block loop
written here (not the trainer's quantizer); one block of the first layer's ``in_proj_qkv`` is all
zeros (its scale 1). ``config.json`` gets the ``quantization_config`` of those releases.
:func:`dequantized_copy` writes the same checkpoint in fp32 with each FP8 weight dequantized
by hand (``fp8 · scale``, block by block) and no ``quantization_config``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CONVERTED = re.compile(
    r"^(model\.language_model\.layers|mtp\.layers)\.\d+\."
    r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.shared_expert\.(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$"
)
ZERO_BLOCK = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"


def blocks(rows: int, cols: int, block):
    bo, bi = block
    for i in range(-(-rows // bo)):
        for j in range(-(-cols // bi)):
            yield i, j, slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi)


def quantize_by_hand(w: torch.Tensor, block, scale_dtype=torch.bfloat16):
    """Per block: ``s = amax / 448`` (1 for zeros) rounded to ``scale_dtype``, then
    ``e4m3(clamp(w / s, ±448))``."""
    rows, cols = w.shape
    data = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-rows // block[0]), -(-cols // block[1]), dtype=scale_dtype)
    for i, j, r, c in blocks(rows, cols, block):
        amax = w[r, c].float().abs().max()
        s = (amax / 448.0 if amax > 0 else torch.tensor(1.0)).to(scale_dtype)
        scale[i, j] = s
        data[r, c] = (w[r, c].float() / s.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return data, scale


def dequantize_by_hand(data: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    out = torch.empty(data.shape)
    for i, j, r, c in blocks(*data.shape, block):
        out[r, c] = data[r, c].float() * scale[i, j].float()
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _write(folder: Path, source: Path, tensors: dict, config_edit) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config_edit(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def export_base(folder: Path, *overrides: str) -> Path:
    """The tiny recipe's model with its MTP head (name-seeded) exported per expert, bf16."""
    from helpers import tiny

    from qwen35_trainer import build_model
    from qwen35_trainer.model import export_hf

    recipe = tiny("model.mtp_layers=1", "data.packing=true", *overrides)
    export_hf(build_model(recipe.model), folder, per_expert=True, dtype=torch.bfloat16)
    return folder


def quantization_config(block) -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head", "model.visual", "mtp.fc"],
    }


def fp8_checkpoint(folder: Path, base: Path, block=(12, 12), keep: tuple[str, ...] = ()) -> Path:
    """``base`` (a bf16 checkpoint, :func:`export_base`) in Qwen's FP8 format (module
    docstring); ``keep``: module prefixes left in bf16 and listed in ``modules_to_not_convert``
    (as third-party FP8 checkpoints do)."""
    out = {}
    for key, value in _tensors(base).items():
        if not CONVERTED.match(key) or key.startswith(keep):
            out[key] = value
            continue
        if key == ZERO_BLOCK:
            value = value.clone()
            value[: block[0], : block[1]] = 0
        out[key], out[f"{key}_scale_inv"] = quantize_by_hand(value, block)

    def edit(config):
        config["quantization_config"] = quantization_config(block)
        config["quantization_config"]["modules_to_not_convert"] += [k.rstrip(".") for k in keep]

    return _write(folder, base, out, edit)


def dequantized_copy(folder: Path, fp8: Path) -> Path:
    """The FP8 checkpoint ``fp8`` in fp32, every FP8 weight dequantized by hand."""
    tensors = _tensors(fp8)
    block = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    block = block["weight_block_size"]
    out = {}
    for key, value in tensors.items():
        if key.endswith("_scale_inv"):
            continue
        if value.dtype == torch.float8_e4m3fn:
            out[key] = dequantize_by_hand(value, tensors[f"{key}_scale_inv"], block)
        else:
            out[key] = value.float()

    def edit(config):
        del config["quantization_config"]
        config["dtype"] = "float32"

    return _write(folder, fp8, out, edit)


def edited_copy(folder: Path, source: Path, tensors=None, config_edit=None) -> Path:
    """A copy of checkpoint ``source`` with ``tensors(dict)`` and ``config_edit(config)``
    applied (the fault-injection checkpoints of the error tests)."""
    loaded = _tensors(source)
    if tensors is not None:
        tensors(loaded)
    shutil.rmtree(folder, ignore_errors=True)
    return _write(folder, source, loaded, config_edit or (lambda config: None))
