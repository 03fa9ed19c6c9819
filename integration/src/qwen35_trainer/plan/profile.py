"""A measured profile of the machine a plan runs on, which :mod:`.timing` prices a plan with
instead of a GPU's datasheet and stated efficiencies (``qwen35-train plan --measure FILE``
writes one, :mod:`.measure`; ``--profile FILE`` reads it).

What it holds, each measured on its device by :func:`.measure.measure_profile`:

- ``flops_per_s``: each op class's throughput (``matmul``, ``head``, ``grouped``,
  ``attention``, ``recurrence``: :data:`OP_CLASS`), forward and backward at the plan's
  own per-rank shapes, with the fixed cost of the op calls it made taken out;
- ``call_s``: the fixed cost of one op call (dispatch, autograd, a kernel launch on a GPU):
  what dominates a small model's step, where most of the ~40,000 calls move a few kB;
- ``calls``: the op calls one micro-batch's forward and backward of the model makes
  (``microbatch``; ``forward``, its forward alone) and the trainer's whole step (``step``: every micro-batch, clipping, the
  optimizer), counted by running them; and ``data_s``, the seconds the recipe's data feed
  takes per step (these belong to the recipe and the trainer's code, not the machine alone:
  ``model`` names the recipe they were measured on); ``other``: the seconds of that
  micro-batch that no class's FLOPs and no call explain (elementwise work) and the forward
  FLOPs it was measured at; ``layouts``: each measured parallel dimension's own cost at degree
  2, per micro-batch and per step (:mod:`.layout_cost`);
- ``memory_bytes_per_s``: the optimizer step's streaming rate (AdamW's bytes over its time);
- ``link``: the local backend's collective bandwidth (bytes a rank sends per second) and latency
  among ``ranks`` processes running side by side (``None`` on a machine of one device, which
  prices only plans that send nothing);
- ``memory``: the bytes one step of the recipe in one process really took on this device
  (:mod:`.memory_probe`: ``allocated``, the tensors' peak; ``persistent``, of it, the
  parameters and optimizer state; ``reserved``, the CUDA allocator's peak, ``None`` on a CPU)
  beside what the planner counts for that same process (``counted``, its tensors' peak;
  ``counted_persistent``): the planner's counted tensors checked against a measurement, and on
  a GPU the allocator's reserve measured (:attr:`Profile.fragmentation`, which replaces the
  stated ``fragmentation`` of :mod:`.headroom` when the plan is priced with this profile);
- ``cores``: what the measured processes shared, so that a plan running more ranks than cores
  on a CPU is priced as the time-sharing it is (:meth:`.measured_time.Measured.time_shared`).

A profile is a JSON object; :meth:`Profile.load` names the file and the key of a bad one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

__all__ = ["CLASSES", "LAYOUT_DIMENSIONS", "OP_CLASS", "Profile"]

CLASSES = ("matmul", "head", "grouped", "attention", "recurrence")
# the op class each kind of FLOPs (:data:`qwen35_trainer.model.flops.KINDS`) runs in
OP_CLASS = {
    "attention": "matmul",
    "attention_core": "attention",
    "gdn": "matmul",
    "gdn_core": "recurrence",
    "shared_expert": "matmul",
    "experts": "grouped",
    "mtp": "matmul",
    "loss": "head",
    "vision": "matmul",
    "vision_core": "attention",
}
# the parallel dimensions whose own cost a profile measures (:mod:`.layout_cost`)
LAYOUT_DIMENSIONS = ("cp", "ep", "tp")
VERSION = 2
MEMORY_KEYS = ("allocated", "persistent", "counted", "counted_persistent")


@dataclasses.dataclass(frozen=True)
class Profile:
    """A measured machine (module docstring); times in seconds, rates per second."""

    device: str  # "cpu" or "cuda", and what it is
    torch: str
    cores: int  # CPU cores the measured processes shared (GPUs: 1 per rank)
    threads: int  # each measured process's intra-op threads
    flops_per_s: dict[str, float]
    call_s: float
    calls: dict[str, float]  # "microbatch", "forward" (of it), "step"
    memory_bytes_per_s: float
    data_s: float
    # "seconds" of a micro-batch no class explains ("forward_seconds" of its forward) at "flops"
    other: dict[str, float]
    layouts: dict[str, dict[str, float]]  # dim -> its own "microbatch" and "step" seconds
    link: dict[str, float]  # "bytes_per_s", "latency_s", "ranks"
    backend: str  # the collectives' backend: gloo, nccl
    model: str  # what the call counts were counted on
    # one process's step: "allocated", "persistent", "reserved" (None on a CPU), "counted",
    # "counted_persistent" (bytes)
    memory: dict[str, int | None]

    @property
    def on_cpu(self) -> bool:
        return self.device.startswith("cpu")

    @property
    def fragmentation(self) -> float | None:
        """The allocator's measured reserve over the tensors a step allocated and freed
        (:attr:`.memory_probe.MemoryPeak.fragmentation`); ``None`` where nothing was reserved
        (a CPU)."""
        from qwen35_trainer.plan.memory_probe import MemoryPeak

        m = self.memory
        return MemoryPeak(m["allocated"], m["persistent"], m["reserved"]).fragmentation

    def with_rates(self, **rates: float) -> Profile:
        """This profile with some op classes' throughputs replaced (FLOP/s)."""
        unknown = sorted(set(rates) - set(CLASSES))
        if unknown:
            raise ValueError(f"unknown op classes {unknown}: expected some of {list(CLASSES)}")
        return dataclasses.replace(self, flops_per_s={**self.flops_per_s, **rates})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(
            json.dumps({"version": VERSION, **dataclasses.asdict(self)}, indent=2) + "\n"
        )

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """The profile in ``path``; ``ValueError`` naming the file and what is wrong."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as err:
            raise ValueError(f"--profile {path}: cannot read it ({err.strerror})") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"--profile {path}: not JSON ({err})") from None
        if not isinstance(data, dict) or data.get("version") != VERSION:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"--profile {path}: expected a profile of version {VERSION} (what "
                f"`qwen35-train plan --measure` writes), found version {found!r}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(fields - set(data))
        if missing:
            raise ValueError(f"--profile {path}: missing keys {missing}")
        rates = data["flops_per_s"]
        absent = [c for c in CLASSES if not isinstance(rates, dict) or c not in rates]
        if absent:
            raise ValueError(f"--profile {path}: flops_per_s lacks the op classes {absent}")
        positive = [(f"flops_per_s.{c}", rates[c]) for c in CLASSES]
        positive += [(k, data[k]) for k in ("call_s", "memory_bytes_per_s")]
        link = data["link"] if isinstance(data["link"], dict) else {}
        if link.get("ranks") != 1:  # one device measures no link
            positive += [(f"link.{k}", link.get(k)) for k in ("bytes_per_s", "latency_s")]
        positive += [
            (f"calls.{k}", (data["calls"] or {}).get(k)) for k in ("microbatch", "forward", "step")
        ]
        positive += [("other.flops", (data["other"] or {}).get("flops"))]
        memory = data["memory"] if isinstance(data["memory"], dict) else {}
        if "reserved" not in memory:
            raise ValueError(f"--profile {path}: memory lacks 'reserved' (null on a CPU)")
        positive += [(f"memory.{k}", memory.get(k)) for k in MEMORY_KEYS]
        if memory.get("reserved") is not None:
            positive += [("memory.reserved", memory["reserved"])]
        other = data["other"] if isinstance(data["other"], dict) else {}
        at_least_0 = [("data_s", data["data_s"])]
        at_least_0 += [(f"other.{k}", other.get(k)) for k in ("seconds", "forward_seconds")]
        for name, value in [*positive, *at_least_0]:
            low = 0 if name in dict(at_least_0) else 1e-300
            if not isinstance(value, (int, float)) or value < low:
                want = ">= 0" if low == 0 else "> 0"
                raise ValueError(f"--profile {path}: {name} must be a number {want}, got {value!r}")
        return cls(**{k: data[k] for k in fields})
