"""Start LoRA from an adapter folder (``model.lora.init_from``): PEFT's ``adapter_config.json``
and ``adapter_model.safetensors``, written by this trainer (:mod:`qwen35_trainer.model.
lora_export`) or by PEFT itself, in either layout of the routed experts' adapters.

The inverse of the export, key by key (``base_model.model.{module}.lora_{A,B}.weight``):

- a dense projection: ``lora_A`` [r, in] and ``lora_B`` [out, r] as they are;
- the fused experts in PEFT's ``target_parameters`` layout: ``experts.base_layer.lora_*``
  (``gate_up_proj``) and ``experts.lora_*`` (``down_proj``), ``A`` [E·r, in] (row ``e·r + k`` =
  ``A[e, k]``) and ``B`` [out, r·E] (column ``k·E + e`` = ``B[e, :, k]``);
- the experts per expert: ``experts.{e}.{gate,up,down}_proj.lora_*`` — ``gate_proj`` and
  ``up_proj`` must share their ``A`` (the fused projection has one input), their ``B`` rows
  stacked, gate first;
- the modules trained in full (its ``modules_to_save``): ``base_model.model.{module}.{param}``.

The scales differ by tool (``lora_alpha / r``, rsLoRA's ``/ sqrt(r)``, ``alpha_pattern`` per
module); the adapter computes ``s_file · B A``, so ``B`` is read as ``B · s_file / s_recipe``: the
same function under the recipe's scale. Everything that cannot be that function is one
``ValueError`` naming both sides: another rank (``r``, ``rank_pattern``), an adapter the recipe
does not have or one it has not (the targets), modules saved that the recipe does not train, a
DoRA or biased adapter.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import torch
from torch import nn

from moe_parallel.moe import Experts
from qwen35_trainer.model.lora.adapters import LoRALinear, lora_spec
from qwen35_trainer.model.lora.peft_export import PREFIX
from qwen35_trainer.model.weights.sources import RowReader, listed
from qwen35_trainer.model.whole import WholeParameter

__all__ = ["AdapterSource"]

logger = logging.getLogger("qwen35_trainer")


def _pattern(patterns: dict, name: str):
    """The value of the first ``patterns`` key matching the end of ``name`` (PEFT's rule)."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", name):
            return value
    return None


def _scale(config: dict, name: str) -> tuple[int, float]:
    """``(rank, scale)`` the adapter file applies to module / parameter ``name``."""
    rank = _pattern(config.get("rank_pattern"), name) or config["r"]
    alpha = _pattern(config.get("alpha_pattern"), name) or config["lora_alpha"]
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


class _Adapter:
    """The folder's tensors and config, and what was read from them."""

    def __init__(self, folder: Path) -> None:
        from safetensors.torch import load_file

        if not folder.is_dir():
            raise ValueError(
                f"model.lora.init_from: {folder} does not exist (a PEFT adapter "
                "folder: adapter_config.json and adapter_model.safetensors)"
            )
        files = [folder / "adapter_config.json", folder / "adapter_model.safetensors"]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"model.lora.init_from: {folder} has no {' or '.join(missing)}")
        self.folder = folder
        self.config = json.loads(files[0].read_text())
        self.tensors = load_file(str(files[1]))
        self.used: set[str] = set()
        self.problems: list[str] = []
        self.from_base: list[str] = []  # modules trained in full the folder did not save

    def take(self, key: str) -> torch.Tensor | None:
        if key not in self.tensors:
            self.problems.append(f"{key}: absent (the recipe adapts that module)")
            return None
        self.used.add(key)
        return self.tensors[key].float()


def _dense(adapter: _Adapter, name: str, module: LoRALinear, s: float):
    at = f"{PREFIX}{name}"
    a, b = adapter.take(f"{at}.lora_A.weight"), adapter.take(f"{at}.lora_B.weight")
    if a is None or b is None:
        return {}
    rank, s_file = _scale(adapter.config, name)
    if a.shape != module.lora_A.shape or b.shape != module.lora_B.shape:
        adapter.problems.append(
            f"{name}: the file's adapter of rank {a.shape[0]} (r {rank}; {list(a.shape)}, "
            f"{list(b.shape)}), the recipe's of rank {module.lora_A.shape[0]} "
            f"({list(module.lora_A.shape)}, {list(module.lora_B.shape)})"
        )
        return {}
    return {f"{name}.lora_A": a, f"{name}.lora_B": b * (s_file / s)}


def _fused(adapter: _Adapter, at: str, experts: int, param: str):
    """``(A [E, r, in], B [E, out, r], file scale)`` of ``experts.{param}`` in PEFT's
    ``target_parameters`` layout."""
    a, b = adapter.take(f"{at}.lora_A.weight"), adapter.take(f"{at}.lora_B.weight")
    if a is None or b is None:
        return None
    rank, s_file = _scale(adapter.config, param)
    if a.shape[0] != experts * rank or b.shape[1] != experts * rank:
        adapter.problems.append(
            f"{at}: adapters {list(a.shape)}, {list(b.shape)} are not {experts} experts of rank "
            f"{rank} (r / rank_pattern)"
        )
        return None
    a = a.reshape(experts, rank, a.shape[1])
    b = b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)
    return a, b, s_file


def _per_expert(adapter: _Adapter, name: str, experts: int, part: str):
    at = [f"{PREFIX}{name}.{e}" for e in range(experts)]
    projs = ("gate_proj", "up_proj") if part == "gate_up" else ("down_proj",)
    a = [[adapter.take(f"{x}.{p}.lora_A.weight") for p in projs] for x in at]
    b = [[adapter.take(f"{x}.{p}.lora_B.weight") for p in projs] for x in at]
    if any(t is None for ts in a + b for t in ts):
        return None
    if any(not torch.equal(ts[0], ts[-1]) for ts in a):
        adapter.problems.append(
            f"{name}: gate_proj and up_proj adapters with different A per expert; the fused "
            "gate_up_proj has one input, so one A"
        )
        return None
    _, s_file = _scale(adapter.config, f"{name}.0.{projs[0]}")
    return torch.stack([ts[0] for ts in a]), torch.stack([torch.cat(ts) for ts in b]), s_file


def _experts(adapter: _Adapter, name: str, module: Experts):
    experts, s = module.num_experts, module.lora_spec.scale
    per_expert = f"{PREFIX}{name}.0.down_proj.lora_A.weight" in adapter.tensors
    out = {}
    for part, at in (("gate_up", f"{PREFIX}{name}.base_layer"), ("down", f"{PREFIX}{name}")):
        if per_expert:
            found = _per_expert(adapter, name, experts, part)
        else:
            found = _fused(adapter, at, experts, f"experts.{part}_proj")
        if found is None:
            continue
        a, b, s_file = found
        want_a, want_b = getattr(module, f"lora_{part}_A"), getattr(module, f"lora_{part}_B")
        if a.shape != want_a.shape or b.shape != want_b.shape:
            adapter.problems.append(
                f"{name} {part}_proj: the file's adapters of rank {a.shape[1]} "
                f"({list(a.shape)}, {list(b.shape)}), the recipe's of rank {want_a.shape[1]} "
                f"({list(want_a.shape)}, {list(want_b.shape)}; model.lora.expert_rank)"
            )
            continue
        out[f"{name}.lora_{part}_A"] = a
        out[f"{name}.lora_{part}_B"] = b * (s_file / s)
    return out


def _saved(adapter: _Adapter, whole: list[WholeParameter], lora, trained) -> dict:
    """The modules the adapter saved in full, for the modules the recipe trains in full
    (``trained``: their names, PEFT's rule applied to the recipe's ``train_modules``)."""
    saved = adapter.config.get("modules_to_save") or []
    extra = sorted(set(saved) - set(lora.train_modules))
    if extra:
        adapter.problems.append(
            f"modules_to_save {extra} are saved in the adapter but not in the recipe's "
            f"model.lora.train_modules {list(lora.train_modules)}"
        )
    out = {}
    for p in whole:
        module = next((m for m in trained if p.name.startswith(f"{m}.")), None)
        key = f"{PREFIX}{p.name}"
        if module is not None and key in adapter.tensors:
            adapter.used.add(key)
            out[p.name] = adapter.tensors[key].float()
    adapter.from_base = sorted({m for m in trained if not any(k.startswith(f"{m}.") for k in out)})
    return out


class AdapterSource:
    """The adapters (and the modules it saved in full) of the PEFT adapter folder ``folder``
    as a weight source (module docstring), for the recipe's ``model.lora`` ``lora`` and the
    names of the modules it trains in full, ``trained`` (``model.lora_trained``)."""

    def __init__(self, folder: str | Path, lora, trained: tuple[str, ...] = ()) -> None:
        self.folder, self.lora, self.trained = Path(folder), lora, tuple(trained)
        self._unreadable = False

    def plan(self, whole: list[WholeParameter], problems: list[str]) -> dict[str, RowReader]:
        try:
            adapter = _Adapter(self.folder)
            _check_kind(adapter.config, self.folder)
        except ValueError as err:
            self._unreadable = True
            problems.append(str(err))
            return {}
        s = lora_spec(self.lora).scale
        modules: dict[str, nn.Module] = {}
        for p in whole:
            modules.setdefault(p.name.removesuffix(f".{p.attr}"), p.module)
        values: dict[str, torch.Tensor] = {}
        for name, module in modules.items():
            if isinstance(module, LoRALinear):
                values |= _dense(adapter, name, module, s)
            elif isinstance(module, Experts) and module.lora_spec is not None:
                values |= _experts(adapter, name, module)
        values |= _saved(adapter, whole, self.lora, self.trained)
        unread = sorted(set(adapter.tensors) - adapter.used)
        if unread:
            adapter.problems.append(
                f"{len(unread)} tensor(s) the recipe has no place for, e.g. {unread[0]} (the "
                "recipe's model.lora.targets / train_modules do not adapt that module)"
            )
        problems += adapter.problems
        if not problems:
            _report(adapter, self.lora, s, len(values), self.trained)
        here = {p.name for p in whole if p.here}
        return {
            name: (lambda lo, hi, t=value: t[lo:hi])
            for name, value in values.items()
            if name in here
        }

    def refusal(self, problems: list[str]) -> str:
        if self._unreadable:
            return problems[0]
        lora = self.lora
        return (
            f"model.lora.init_from {self.folder} does not fit the recipe's model.lora "
            f"(rank {lora.rank}, expert_rank {lora.experts_rank}, targets "
            f"{list(lora.targets)}): {listed(problems, 8)}"
        )


def _check_kind(config: dict, folder: Path) -> None:
    """``ValueError`` unless ``config`` is a plain LoRA adapter listing its modules."""
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"model.lora.init_from: {folder} is not a plain LoRA adapter")
    if isinstance(config.get("target_modules"), str):
        raise ValueError(
            f"model.lora.init_from: {folder}'s target_modules is a pattern "
            f"({config['target_modules']!r}); the tensors are read by name, list the modules"
        )


def _report(adapter: _Adapter, lora, s: float, tensors: int, trained) -> None:
    """Log what was loaded: the file, its rank, alpha and scale against the recipe's, and the
    modules trained in full it saved (or that start from the base)."""
    config = adapter.config
    rank, s_file = _scale(config, "")
    logger.info(
        "model.lora.init_from %s: %d tensors; the file's r=%s, lora_alpha=%s (scale %.4g%s), "
        "read under the recipe's scale %.4g (rank %d, alpha %g); modules trained in full "
        "loaded: %s%s",
        adapter.folder / "adapter_model.safetensors",
        tensors,
        rank,
        config.get("lora_alpha"),
        s_file,
        ", rsLoRA" if config.get("use_rslora") else "",
        s,
        lora.rank,
        lora.alpha,
        sorted(set(trained) - set(adapter.from_base)) or "none",
        (
            f"; {adapter.from_base} start from the base checkpoint (the adapter saved none of "
            "them: its modules_to_save)"
            if adapter.from_base
            else ""
        ),
    )
