"""``qwen35-train plan RECIPE --measure FILE``: time what a plan executes on this machine and
write the :class:`.profile.Profile` that :mod:`.timing` prices it with.

Each measurement runs on this process's device (CUDA where present, else the CPU) at the plan's
own per-rank shapes (:func:`.planner.row_shape`: this rank's tokens under CP and sequence
parallelism, the routed rows per local expert, the documents of a packed row), forward and
backward, after one warm-up, the median of a few runs:

- the fixed cost of one op call: a chain of small elementwise ops with autograd, its time over
  the op calls it made (counted by a dispatch mode, :class:`CallCounter`, as every count here);
- each op class (:data:`.profile.CLASSES`): its FLOPs (the formulas of
  :func:`qwen35_trainer.model.flops.forward_flops`, times their passes) over its time less its
  calls' fixed cost, so that a class's rate is what its arithmetic runs at — ``matmul``: a
  projection as wide as the model's widest; ``head``: the chunked ``lm_head`` + loss over the
  vocabulary (:func:`chunked_loss.linear_cross_entropy`); ``grouped``: the routed experts'
  SwiGLU over this rank's experts (:func:`moe_parallel.grouped.expert_swiglu`); ``attention``:
  SDPA per document; ``recurrence``: the chunked gated delta rule
  (:func:`cp_varlen_attn.gated_delta_rule`);
- the calls: one micro-batch's forward and backward of the recipe's model, and the trainer's
  whole step (:func:`qwen35_trainer.train.pipeline_step.step_function`: every micro-batch, the
  clipping, the optimizer), built by the trainer's own code in one process (every degree 1: a
  rank runs every layer of its stage, so the calls per layer are a rank's; collectives are
  priced as links); and the seconds the recipe's data feed takes per step, read here;
- the rest: that micro-batch's measured seconds (and its forward's alone: what activation
  checkpointing runs again) less what the classes and calls explain (:func:`unexplained`:
  elementwise ops, norms, the tower's activations), with the forward FLOPs it came with, so
  that a rank with a share of those FLOPs (its tokens) gets that share;
- the optimizer's streaming rate: AdamW over the rank's trained parameters (at most 2^24);
- the link: :func:`.links.measure_link` — ``ranks`` processes side by side on the local backend;
- each parallel dimension the plan uses, its own cost at degree 2 on 2 local ranks
  (:mod:`.layout_cost`);
- the memory of one step in one process (:func:`.memory_probe.measure_peak`) beside what the
  planner counts for it (:func:`_memory`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from qwen35_trainer.plan.profile import LAYOUT_DIMENSIONS, OP_CLASS, Profile
from qwen35_trainer.plan.step_probe import CallCounter, probe_step, single_process, timed

__all__ = ["CallCounter", "class_rates", "measure_profile", "timed"]

OPTIMIZER_NUMEL = 1 << 24
# a machine with one device measures no link: a one-rank plan sends nothing
ONE_DEVICE_LINK = {"bytes_per_s": None, "latency_s": None, "ranks": 1, "message_bytes": 0}


def call_cost(device: torch.device) -> float:
    """Seconds of one op call's fixed cost (module docstring)."""
    x = torch.randn(16, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(200):
            y = y * 1.0001 + 0.0001
        y.sum().backward()

    seconds, calls = timed(chain, device, repeats=5)
    return seconds / calls


def _fwd_bwd(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    def run():
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
        for t in inputs:
            t.grad = None

    return run


def _leaf(*shape, device, dtype, scale: float = 0.1) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_()


def _class_ops(text, shape, dims, documents, device, dtype, chunk):
    """Per op class: ``(forward+backward closure, its FLOPs)`` at the plan's shapes."""
    from chunked_loss import linear_cross_entropy
    from cp_varlen_attn import gated_delta_rule
    from moe_parallel.grouped import expert_swiglu

    tokens = max(1, shape.tokens)
    split_tokens = max(1, tokens // shape.sequence_split)
    h = text.hidden_size
    leaf = dict(device=device, dtype=dtype)
    widest = max(
        2 * text.num_attention_heads * text.head_dim,
        text.shared_expert_intermediate_size,
        text.linear_num_value_heads * text.linear_value_head_dim * 2,
    )
    width = max(1, widest // dims.tp)
    x, w = _leaf(tokens, h, **leaf), _leaf(width, h, **leaf)
    ops = {"matmul": (_fwd_bwd(F.linear, x, w), 3 * 2 * tokens * h * width)}

    vocab = text.vocab_size
    hidden, head = _leaf(split_tokens, h, **leaf), _leaf(vocab, h, **leaf)
    labels = torch.randint(0, vocab, (split_tokens,), device=device)
    loss = lambda a, b: linear_cross_entropy(a, b, labels, chunk_size=chunk)  # noqa: E731
    ops["head"] = (_fwd_bwd(loss, hidden, head), 3 * 2 * split_tokens * h * vocab)

    experts = max(1, text.num_experts // dims.ep)
    inter = text.moe_intermediate_size
    rows = split_tokens * text.num_experts_per_tok
    counts = torch.full((experts,), rows // experts, dtype=torch.long, device=device)
    counts[0] += rows - int(counts.sum())
    rows_x = _leaf(rows, h, **leaf)
    gate_up, down = _leaf(experts, 2 * inter, h, **leaf), _leaf(experts, h, inter, **leaf)
    swiglu = lambda a, b, c: expert_swiglu(a, counts, b, c, backend="torch")  # noqa: E731
    ops["grouped"] = (_fwd_bwd(swiglu, rows_x, gate_up, down), 3 * 2 * rows * h * 3 * inter)

    heads = max(1, text.num_attention_heads // dims.tp)
    kv_heads, d = max(1, text.num_key_value_heads // dims.tp), text.head_dim
    docs = [max(1, n // dims.cp) for n in documents] or [tokens]
    qkv = [_leaf(1, heads if i == 0 else kv_heads, sum(docs), d, **leaf) for i in range(3)]

    def attention(q, k, v):
        outs, start = [], 0
        for n in docs:
            piece = slice(start, start + n)
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, piece],
                    k[:, :, piece],
                    v[:, :, piece],
                    is_causal=True,
                    enable_gqa=heads != kv_heads,
                )
            )
            start += n
        return torch.cat(outs, dim=2)

    pairs = sum(n * (n + 1) // 2 for n in docs)
    ops["attention"] = (_fwd_bwd(attention, *qkv), 3 * 4 * heads * d * pairs)

    hk = max(1, text.linear_num_key_heads // dims.tp)
    hv = max(1, text.linear_num_value_heads // dims.tp)
    kd, vd = text.linear_key_head_dim, text.linear_value_head_dim
    q, k = _leaf(1, tokens, hk, kd, **leaf), _leaf(1, tokens, hk, kd, **leaf)
    v = _leaf(1, tokens, hv, vd, **leaf)
    g = (-torch.rand(1, tokens, hv, device=device, dtype=dtype)).requires_grad_()
    beta = torch.rand(1, tokens, hv, device=device, dtype=dtype).requires_grad_()
    bounds = [0]
    for n in docs:
        bounds.append(min(bounds[-1] + n, tokens))
    gdn = lambda *t: gated_delta_rule(*t, cu_seqlens=bounds, backend="torch")  # noqa: E731
    ops["recurrence"] = (_fwd_bwd(gdn, q, k, v, g, beta), 3 * tokens * 3 * 2 * hv * kd * vd)
    return ops


def class_rates(recipe, plan, device: torch.device, call_s: float) -> dict[str, float]:
    """Each op class's FLOP/s at ``plan``'s per-rank shapes (module docstring)."""
    from qwen35_trainer.model import build_config
    from qwen35_trainer.plan.planner import row_shape
    from qwen35_trainer.plan.work import row_documents

    text = build_config(recipe.model).text_config
    dims = plan.step.dims
    shape = row_shape(recipe, dims.cp)
    dtype = torch.bfloat16 if recipe.train.dtype == "bfloat16" else torch.float32
    docs = row_documents(recipe, shape.row_tokens)
    ops = _class_ops(text, shape, dims, docs, device, dtype, recipe.train.loss_chunk_size)
    rates = {}
    for name, (run, flops) in ops.items():
        seconds, calls = timed(run, device)
        # the arithmetic's own time: never less than a tenth of the whole (tiny shapes)
        rates[name] = flops / max(seconds - calls * call_s, seconds / 10)
    return rates


def _whole_work(one, config, grids):
    """The :class:`.work.Work` of the one-process recipe ``one``'s micro-batch whose images and
    videos have the patch grids ``grids`` (the timed one's: its tower's FLOPs are its own)."""
    from qwen35_trainer.parallel import validate_layout
    from qwen35_trainer.plan.planner import row_shape
    from qwen35_trainer.plan.stages import StageView
    from qwen35_trainer.plan.work import rank_work

    dims = validate_layout(one, 1, on_this_machine=False)
    types = tuple(config.text_config.layer_types)
    whole = StageView(types, True, True, 1.0, 0, 0)
    return rank_work(one, config, dims, row_shape(one, 1, grids), whole)


def unexplained(seconds: float, flops: dict, rates: dict, calls: float, call_s: float) -> float:
    """What of ``seconds`` measured the op classes (``flops`` per kind executed) and the calls
    do not explain (elementwise ops, norms, activations: work no class's FLOPs count), never
    below 0."""
    classes = sum(f / rates[OP_CLASS[k]] for k, f in flops.items())
    return max(seconds - classes - calls * call_s, 0.0)


def _adamw_rate(device: torch.device) -> float:
    """AdamW's streaming rate: the bytes :mod:`.timing` counts for it (``3·G + 2·O``: fp32
    weights, gradients and moments) over one step's time."""
    weight = torch.zeros(OPTIMIZER_NUMEL, device=device, requires_grad=True)
    weight.grad = torch.ones_like(weight)
    optimizer = torch.optim.AdamW([weight], lr=1e-6)
    seconds, _ = timed(optimizer.step, device)
    return (3 * 4 + 2 * 8) * OPTIMIZER_NUMEL / seconds


def measure_profile(
    recipe, plan, name: str, link_ranks: int | None = None, dims: list[str] | None = None
) -> Profile:
    """The :class:`.profile.Profile` of this machine for ``plan`` of ``recipe`` (module
    docstring); ``link_ranks``: the processes the link is measured among (default: the
    plan's world on a CPU, capped at 8; the GPUs here on CUDA); ``dims``: the parallel
    dimensions whose own cost is measured (:mod:`.layout_cost`; default: those the plan
    uses)."""
    import dataclasses
    import os

    from qwen35_trainer.plan.layout_cost import layout_costs
    from qwen35_trainer.plan.links import measure_link

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name_of = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    call_s = call_cost(device)
    rates = class_rates(recipe, plan, device, call_s)
    one = single_process(recipe)
    probe = probe_step(one, device)
    calls, seconds = probe.calls, probe.seconds
    work = _whole_work(one, probe.config, probe.grids)
    other_s = unexplained(
        seconds["microbatch"], work.executed(), rates, calls["microbatch"], call_s
    )
    other_forward = unexplained(seconds["forward"], work.forward, rates, calls["forward"], call_s)
    if device.type == "cuda":
        ranks, cores = link_ranks or min(torch.cuda.device_count(), 8), 1
    else:
        ranks, cores = link_ranks or min(max(plan.world, 2), 8), os.cpu_count() or 1
    wanted = [d for d in LAYOUT_DIMENSIONS if plan.layout.get(d, 1) > 1] if dims is None else dims
    if ranks < 2 and (wanted or plan.world > 1):
        raise ValueError(
            f"--measure times the link and the layouts on 2 local ranks; this machine has "
            f"{ranks} {device.type} device(s): measure a one-rank plan here"
        )
    link = measure_link(ranks, plan) if ranks > 1 else ONE_DEVICE_LINK
    profile = Profile(
        device=f"{device.type} ({name_of})",
        torch=torch.__version__,
        cores=cores,
        threads=torch.get_num_threads(),
        flops_per_s=rates,
        call_s=call_s,
        calls=calls,
        memory_bytes_per_s=_adamw_rate(device),
        data_s=probe.data_s,
        other={
            "seconds": other_s,
            "forward_seconds": other_forward,
            "flops": sum(work.forward.values()),
        },
        link=link,
        backend="nccl" if device.type == "cuda" else "gloo",
        model=name,
        layouts={},
        memory=_memory(one, device),
    )
    return dataclasses.replace(profile, layouts=layout_costs(recipe, profile, wanted))


def _memory(one, device: torch.device) -> dict[str, int | None]:
    """One process's measured step (:func:`.memory_probe.measure_peak`) and the planner's
    count for the same process (:class:`.profile.Profile`'s ``memory``)."""
    from qwen35_trainer.plan.memory_probe import measure_peak
    from qwen35_trainer.plan.planner import plan

    peak = measure_peak(one, device)
    counted = plan(one).ranks[0]
    return {
        "allocated": peak.allocated,
        "persistent": peak.persistent,
        "reserved": peak.reserved,
        "counted": counted.peak,
        "counted_persistent": counted.parameters + counted.optimizer,
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"
