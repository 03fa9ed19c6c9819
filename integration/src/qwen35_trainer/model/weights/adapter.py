"""The ONE map between a transformers checkpoint on disk and the runtime state dict.

The runtime names are transformers' own (our model is ``Qwen3_5MoeForConditionalGeneration``
with MoE blocks holding the same tensors under the same names). On disk they agree except for
the routed experts, which come in two layouts:

- stacked, as in memory: ``…mlp.experts.gate_up_proj [E, 2I, H]``, ``…mlp.experts.down_proj
  [E, H, I]``;
- per expert, as transformers' ``save_pretrained`` writes them (and some published checkpoints
  hold, e.g. for their MTP experts): ``…mlp.experts.{e}.gate_proj.weight [I, H]``,
  ``…up_proj.weight [I, H]``, ``…down_proj.weight [H, I]``; the stacked expert ``e`` is
  ``cat(gate_e, up_e)`` along its rows (transformers' own conversion, checked by the tests
  against ``from_pretrained``).

Both load. On export (:func:`on_disk`) the decoder's experts are written stacked or per expert
(the source checkpoint's layout, :func:`expert_layout`, unless asked otherwise), the MTP
head's always per expert: the public checkpoints' layout, which the servers' MTP loaders read.

An FP8 checkpoint (Qwen's releases) stores its converted weights as float8_e4m3fn with a
``…weight_scale_inv`` beside each (the per-expert ones too); the map is the same, the scales
travel with their weights, and every on-disk tensor's dtype is checked before anything is read
(:mod:`qwen35_trainer.model.weights.stored`).

Multi-token-prediction tensors (``mtp.*``) load like the rest when the model has its MTP head
(:mod:`qwen35_trainer.model.mtp`); a model without one (``model.mtp_layers: 0``) reports and
skips them (``skipped``). :class:`CheckpointFiles` reads tensors through the safetensors library (no pickle),
row spans only (``safe_open(...).get_slice``), so a rank never reads more than its shard's
dim-0 span of one tensor at a time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from qwen35_trainer.model.weights.stored import Stored

__all__ = ["CheckpointFiles", "StateDictAdapter", "expert_layout", "on_disk"]

_STACKED = re.compile(r"^(?P<base>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")

# The one runtime prefix whose experts are written per expert (the public MTP layout).
_PER_EXPERT_ON_DISK = "mtp."


def on_disk(name: str, shape: tuple[int, ...], *, per_expert: bool = False):
    """How runtime tensor ``name`` (full shape ``shape``) is written: ``[(disk name, disk
    shape, take)]`` where ``take(full)`` cuts that tensor out of the full runtime tensor —
    itself, or for stacked experts written per expert (the MTP head's always, the decoder's
    with ``per_expert``) one tensor per expert and projection (expert ``e``'s ``gate_proj`` /
    ``up_proj`` the first / second half of ``gate_up_proj[e]``'s rows)."""
    stacked = _STACKED.match(name)
    if stacked is None or not (per_expert or name.startswith(_PER_EXPERT_ON_DISK)):
        return [(name, tuple(shape), lambda full: full)]
    experts, rows, cols = shape
    base = stacked["base"]
    if stacked["proj"] == "down_proj":
        return [
            (f"{base}.{e}.down_proj.weight", (rows, cols), lambda full, e=e: full[e])
            for e in range(experts)
        ]
    half = rows // 2
    return [
        (
            f"{base}.{e}.{part}.weight",
            (half, cols),
            lambda full, e=e, k=k: full[e, k * half : (k + 1) * half],
        )
        for e in range(experts)
        for k, part in enumerate(("gate_proj", "up_proj"))
    ]


# Bytes read through one open file before it is closed and reopened: safetensors maps the file
# into memory, and the pages read stay in this process's RSS until the mapping goes.
MAPPED_WINDOW_BYTES = 1 << 30


class CheckpointFiles:
    """The tensors of a checkpoint directory's ``*.safetensors`` files (the index, when there
    is one, says which file holds which tensor). At most ``window_bytes`` read from a file stay
    mapped: then it is reopened, so host memory holds the shards read plus one window."""

    def __init__(self, path: str | Path, *, window_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.window_bytes = MAPPED_WINDOW_BYTES if window_bytes is None else window_bytes
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model.weights: no *.safetensors file in {self.path}")
        self._handles: dict[str, object] = {}
        self._read: dict[str, int] = {}
        self.where: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for name in files:
            if not (self.path / name).is_file():
                raise ValueError(f"model.weights: {index} names {name}, which is not there")
            handle = self._open(name)
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                self.where[key] = name
                tensor = handle.get_slice(key)
                self._shapes[key] = tuple(tensor.get_shape())
                self._dtypes[key] = tensor.get_dtype()
            self._handles.pop(name)

    def _open(self, name: str):
        from safetensors import safe_open

        if name not in self._handles:
            self._handles[name] = safe_open(str(self.path / name), framework="pt")
            self._read[name] = 0
        return self._handles[name]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def dtype(self, key: str) -> str:
        """Tensor ``key``'s safetensors dtype name (``BF16``, ``F8_E4M3``, ``I64``, ...)."""
        return self._dtypes[key]

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of tensor ``key`` (dim 0), as stored: a view of the file's mapping,
        which stays valid (mapped) while the view lives, even after the file is reopened."""
        name = self.where[key]
        rows = self._open(name).get_slice(key)[lo:hi]
        self._read[name] += rows.numel() * rows.element_size()
        if self._read[name] >= self.window_bytes:
            del self._handles[name]  # unmaps the pages read so far
        return rows


class StateDictAdapter:
    """Runtime name → its tensors on disk (:class:`~qwen35_trainer.model.weights.stored.Stored`),
    checked against the runtime shapes and for their dtypes; ``block``: the FP8 checkpoint's
    ``weight_block_size`` (``None``: not an FP8 checkpoint). ``skipped``: prefixes of on-disk
    tensors the model has no place for, left unread (and reported) instead of refused."""

    def __init__(
        self,
        files: CheckpointFiles,
        *,
        skipped: tuple[str, ...] = (),
        block: tuple[int, int] | None = None,
    ) -> None:
        self.files = files
        self.skipped = skipped
        self.block = block
        self.used: set[str] = set()

    def stored(self, name: str, shape: tuple[int, ...], problems: list[str]) -> Stored | None:
        """Runtime weight ``name``'s (full shape ``shape``) tensors on disk, or ``None`` with
        the reasons appended to ``problems``."""
        files = self.files
        if name in files.where:
            self.used.add(name)
            if files.shape(name) != tuple(shape):
                problems.append(
                    f"{name}: shape {list(files.shape(name))} on disk, {list(shape)} expected"
                )
                return None
            return self._checked([[name]], False, problems)
        stacked = _STACKED.match(name)
        if stacked is None:
            problems.append(f"{name}: missing (runtime shape {list(shape)})")
            return None
        return self._per_expert(stacked["base"], stacked["proj"], name, shape, problems)

    def _checked(self, keys, stacked: bool, problems: list[str]) -> Stored | None:
        found = Stored.check(self.files, keys, stacked, self.block, problems)
        if found is not None:
            self.used.update(found.used())
        return found

    def _per_expert(self, base, proj, name, shape, problems) -> Stored | None:
        experts, rows, cols = shape
        parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
        keys = [[f"{base}.{e}.{part}.weight" for part in parts] for e in range(experts)]
        absent = [k for ks in keys for k in ks if k not in self.files.where]
        if absent:
            problems.append(
                f"{name}: missing (neither stacked nor per expert; e.g. {absent[0]} "
                f"absent, {len(absent)} per-expert tensors in all)"
            )
            return None
        part_shape = (rows // len(parts), cols)
        wrong = [k for ks in keys for k in ks if self.files.shape(k) != part_shape]
        self.used.update(k for ks in keys for k in ks)
        if wrong:
            problems.append(
                f"{name}: per-expert tensors of shape {list(part_shape)} expected, "
                f"{wrong[0]} is {list(self.files.shape(wrong[0]))}"
            )
            return None
        return self._checked(keys, True, problems)

    def unused(self) -> tuple[list[str], list[str]]:
        """On-disk tensors no runtime tensor read: ``(skipped, unexpected)``."""
        rest = sorted(set(self.files.where) - self.used)
        skipped = [k for k in rest if self.skipped and k.startswith(self.skipped)]
        return skipped, [k for k in rest if not (self.skipped and k.startswith(self.skipped))]


def expert_layout(files: CheckpointFiles) -> str | None:
    """How ``files`` store the decoder's routed experts: ``"per_expert"``, ``"stacked"``, or
    ``None`` when they hold no expert tensor (the MTP head's own layout does not count)."""
    decoder = [key for key in files.where if not key.startswith(_PER_EXPERT_ON_DISK)]
    if any(_PER_EXPERT.search(key) for key in decoder):
        return "per_expert"
    if any(_STACKED.match(key) for key in decoder):
        return "stacked"
    return None
