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
skips them (``skipped``). The tensors are read through :class:`~qwen35_trainer.model.weights.
files.CheckpointFiles`, row spans only.
"""

from __future__ import annotations

import re

from qwen35_trainer.model.weights.files import CheckpointFiles
from qwen35_trainer.model.weights.stored import Stored

__all__ = ["StateDictAdapter", "expert_layout", "fp8_weights", "on_disk"]

_STACKED = re.compile(r"^(?P<base>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
_PER_EXPERT_PART = re.compile(
    r"^(?P<base>.+\.experts)\.\d+\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)

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


def fp8_weights(files: CheckpointFiles) -> set[str]:
    """The runtime weights ``files`` store in float8 (``F8_E4M3``): a dense ``…weight``, or the
    routed experts' ``…experts.gate_up_proj`` / ``down_proj`` whose parts (stacked, or every
    expert's) are float8."""
    out = set()
    for key in files.where:
        if files.dtype(key) != "F8_E4M3":
            continue
        part = _PER_EXPERT_PART.match(key)
        if part is not None:
            out.add(
                f"{part['base']}.{'down_proj' if part['proj'] == 'down_proj' else 'gate_up_proj'}"
            )
        else:
            out.add(key)
    return out
