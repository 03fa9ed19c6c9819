"""Checks run on every rank of a gloo launch (see test_train_dp.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch.distributed as dist
from helpers import TINY, demo_recipe, tiny

from dist_testkit import assert_close, cpu_cuda_streams, cpu_micro_pipeline_tp, host_memory
from fsdp_compat import full_tensor
from qwen35_trainer import load_recipe, train
from qwen35_trainer.supervise.run_folder import step_records

STEPS = 3
GLOBAL_SAMPLES = 4


def layout_recipe(world: int, *overrides: str):
    """``world`` ranks, each with GLOBAL_SAMPLES / world rows of the same global batch."""
    return tiny(
        f"parallel.dp={world}",
        f"data.samples_per_rank={GLOBAL_SAMPLES // world}",
        f"train.steps={STEPS}",
        "model.expert_backend=torch",
        "data.packing=false",
        "train.eps=0.001",
        *overrides,
    )


FIELDS = ("loss", "ce", "aux", "grad_norm")


def assert_same_run(
    logs,
    reference_logs,
    state,
    reference_state,
    *,
    fields=FIELDS,
    rel=1e-5,
    param_rtol=1e-4,
    param_norm_rel=None,
) -> None:
    """Per step: global loss, CE, aux loss, gradient norm (rel ``rel``) and token count; then
    the final parameters (gathered when sharded): elementwise, or with ``param_norm_rel`` by
    each tensor's relative distance."""
    for ours, ref in zip(logs, reference_logs, strict=True):
        assert (ours.step, ours.tokens) == (ref.step, ref.tokens), (ours, ref)
        for field in fields:
            mine, theirs = getattr(ours, field), getattr(ref, field)
            if isinstance(theirs, tuple):  # per depth (mtp_loss)
                assert len(mine) == len(theirs), (field, ours, ref)
            else:
                mine, theirs = (mine,), (theirs,)
            for a, b in zip(mine, theirs, strict=True):
                assert abs(a - b) <= rel * (1 + abs(b)), (field, ours, ref)
    # AdamW divides by sqrt(v) + eps: with the default eps, fp32 round-off in a near-zero
    # gradient can move that element by up to lr per step, so these runs use eps = 1e-3 (a
    # smooth update); a wrong gradient scale, which Adam partly hides, is caught by the per-step
    # gradient norms above.
    lr = layout_recipe(1).train.lr
    assert list(state) == list(reference_state)
    for name, value in state.items():
        ours, ref = full_tensor(value).float(), reference_state[name]
        if param_norm_rel is None:
            assert_close(ours, ref, rtol=param_rtol, atol=1e-3 * lr, name=name)
        else:  # per tensor, Frobenius: |ours - ref| <= rel * (|ref| + |one Adam step|)
            gap, size = float((ours - ref).norm()), float(ref.norm()) + lr * ref.numel() ** 0.5
            assert gap <= param_norm_rel * size, (name, gap, size)


def check_training_equals_one_process(
    overrides, reference_logs, reference_state, compare=None
) -> None:
    """The layout ``overrides`` over every rank equals one process on the global batch.
    ``compare``: :func:`assert_same_run` keyword arguments (fields, tolerances)."""
    result = train(layout_recipe(dist.get_world_size(), *overrides))
    state = result.objective.model.state_dict()
    assert_same_run(result.logs, reference_logs, state, reference_state, **(compare or {}))


def check_megatron_equals_one_process(
    overrides, reference_logs, reference_state, compare=None, resume_dir=None
) -> None:
    """:func:`check_training_equals_one_process` with ``parallel.fsdp_backend=megatron``: the
    real megatron-fsdp on these CPU ranks (:func:`dist_testkit.cpu_cuda_streams`). With
    ``resume_dir``, the run is also stopped after 1 step (a checkpoint) and resumed: steps 2..3
    and the final parameters equal its own uninterrupted run."""
    world = dist.get_world_size()
    with cpu_cuda_streams():
        recipe = layout_recipe(world, "parallel.fsdp_backend=megatron", *overrides)
        result = train(recipe)
        state = {k: full_tensor(v).float() for k, v in result.objective.model.state_dict().items()}
        assert_same_run(result.logs, reference_logs, state, reference_state, **(compare or {}))
        if resume_dir is None:
            return
        stop = (*overrides, f"train.checkpoint_dir={resume_dir}")
        train(layout_recipe(world, "parallel.fsdp_backend=megatron", *stop, "train.steps=1"))
        resumed = train(layout_recipe(world, "parallel.fsdp_backend=megatron", *stop))
        fields = (compare or {}).get("fields", FIELDS)
        assert_same_run(
            resumed.logs,
            result.logs[1:],
            resumed.objective.model.state_dict(),
            state,
            fields=fields,
            rel=1e-6,
            param_rtol=1e-6,
        )


def check_checkpoints_cross_backends(path, reference_logs, reference_state) -> None:
    """A checkpoint holds global tensors whichever backend wrote it
    (:func:`fsdp_compat.dcp_ready`): DP 2 stopped after 1 step on megatron-fsdp and resumed on
    FSDP2, and the other way round; steps 2..3 and the final parameters equal one process."""
    world = dist.get_world_size()
    with cpu_cuda_streams():
        for first, then in (("megatron", "fsdp2"), ("fsdp2", "megatron")):
            saved = f"train.checkpoint_dir={path}/{first}"
            train(layout_recipe(world, f"parallel.fsdp_backend={first}", saved, "train.steps=1"))
            result = train(layout_recipe(world, f"parallel.fsdp_backend={then}", saved))
            state = result.objective.model.state_dict()
            assert_same_run(result.logs, reference_logs[1:], state, reference_state)


def check_resume_equals_uninterrupted(
    overrides, path, reference_logs, reference_state, compare=None
) -> None:
    """Stop after 1 step (checkpoint), start again: steps 2..3 and the final parameters equal
    the uninterrupted one-process run. ``compare``: :func:`assert_same_run` keyword
    arguments."""
    world = dist.get_world_size()
    first = train(layout_recipe(world, *overrides, "train.steps=1", f"train.checkpoint_dir={path}"))
    assert [log.step for log in first.logs] == [1]
    result = train(layout_recipe(world, *overrides, f"train.checkpoint_dir={path}"))
    state = result.objective.model.state_dict()
    assert_same_run(result.logs, reference_logs[1:], state, reference_state, **(compare or {}))


def check_resume_skips_a_damaged_checkpoint(
    overrides, path, reference_logs, reference_state
) -> None:
    """Checkpoints after steps 1 and 2, then one byte of rank 1's shard of step 2 flipped: only
    the rank that hashes that file can see it, yet every rank skips step 2 (warning with the
    file), resumes from step 1, and steps 2..3 equal the uninterrupted one-process run."""
    world = dist.get_world_size()
    run = (*overrides, f"train.checkpoint_dir={path}", "train.checkpoint_every=1")
    train(layout_recipe(world, *run, "train.steps=2"))
    if dist.get_rank() == 1:
        shard = Path(path) / "step_000002" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    dist.barrier()
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("qwen35_trainer").addHandler(handler)
    try:
        result = train(layout_recipe(world, *run))
    finally:
        logging.getLogger("qwen35_trainer").removeHandler(handler)
    damaged = [w for w in warned if "is damaged" in w]
    assert len(damaged) == 1 and "step_000002 is damaged" in damaged[0], warned
    assert "__1_0.distcp: checksum" in damaged[0], damaged
    state = result.objective.model.state_dict()
    assert_same_run(result.logs, reference_logs[1:], state, reference_state)


def sharded_model(world: int, overrides, weights: str | None = None):
    """The tiny model built on meta, parallelised under the layout ``overrides`` and
    materialised (name-seeded, or from the checkpoint directory ``weights``)."""
    import torch

    from qwen35_trainer import build_training_model

    r = layout_recipe(world, *overrides, *([f"model.weights={weights}"] if weights else []))
    return build_training_model(r, torch.device("cpu"))[0].model


def check_materialized_weights(overrides, expected) -> None:
    """Per source (``None``: name-seeded init, else a checkpoint directory), every parameter of
    the sharded model, reassembled, equals the one-process tensor bit for bit."""
    import torch

    from qwen35_trainer.model.params import named_parameters

    for weights, state in expected.items():
        model = sharded_model(dist.get_world_size(), overrides, weights)
        names = []
        for name, _, _, param in named_parameters(model):
            names.append(name)
            assert torch.equal(full_tensor(param).detach(), state[name]), (weights, name)
        assert sorted(names) == sorted(state), weights


def check_megatron_materialized_weights(overrides, expected) -> None:
    """:func:`check_materialized_weights` with ``parallel.fsdp_backend=megatron`` (the real
    megatron-fsdp on these CPU ranks), which materialises the meta model one unit at a time as
    it shards it: no parameter is allocated when megatron-fsdp starts, and the weights the
    optimizer steps (fp32, in bf16 too) are the one-process ones bit for bit."""
    from unittest import mock

    import torch

    import qwen35_trainer.parallel.megatron as megatron
    from qwen35_trainer import build_training_model

    shard_model = megatron.shard_model

    def starts_on_meta(objective, *args, **kwargs):
        allocated = [name for name, p in objective.named_parameters() if not p.is_meta]
        assert not allocated, f"allocated before megatron-fsdp shards them: {allocated[:3]}"
        return shard_model(objective, *args, **kwargs)

    with cpu_cuda_streams(), mock.patch.object(megatron, "shard_model", starts_on_meta):
        check_materialized_weights(("parallel.fsdp_backend=megatron", *overrides), expected)
        # fp32: the weight buffer is the optimizer's, no second fp32 copy of this rank's shard;
        # bf16: bf16 weights over fp32 main weights (those compared above)
        r = layout_recipe(dist.get_world_size(), "parallel.fsdp_backend=megatron", *overrides)
        objective = build_training_model(r, torch.device("cpu"))[0]
        bf16 = r.train.dtype == "bfloat16"
        for group in objective.megatron.param_and_grad_buffer.parameter_groups:
            assert (group.main_weight_buffer is not None) == bf16
            assert group.model_weight_buffer.dtype == (torch.bfloat16 if bf16 else torch.float32)


def measured_state_bytes(overrides) -> dict[str, int]:
    """After one training step of the tiny layout ``overrides``: this rank's bytes of parameter
    shards, gradient shards and optimizer state, and (pipeline stages, whose FSDP reduction is
    finalised by hand) the unsharded gradients held when the reduction starts (for the
    planner's exact counts)."""
    import torch

    from qwen35_trainer import train

    captured = {}

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def grads_before_step(optimizer, args, kwargs):  # the step clears them afterwards
        captured["gradients"] = sum(
            local(p.grad).numel() * p.grad.dtype.itemsize
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        )

    from torch.distributed.fsdp import FSDPModule
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    finalize = FSDPModule.finalize_backward
    captured["unsharded_grads"] = captured["unsharded_params"] = 0

    def unsharded_before_reduce(module, **kwargs):  # a pipeline stage's, after its backward
        states = module._get_fsdp_state()._state_ctx.all_states
        unsharded = [
            param
            for state in states
            for group in state._fsdp_param_groups
            for fsdp_param in group.fsdp_params
            if (param := getattr(fsdp_param, "_unsharded_param", None)) is not None
        ]
        captured["unsharded_grads"] += sum(
            local(p.grad).numel() * p.grad.dtype.itemsize for p in unsharded if p.grad is not None
        )
        captured["unsharded_params"] += sum(  # those whose data is allocated (gathered)
            local(p).numel() * p.dtype.itemsize
            for p in unsharded
            if local(p).untyped_storage().nbytes()
        )
        return finalize(module, **kwargs)

    hook = register_optimizer_step_pre_hook(grads_before_step)
    FSDPModule.finalize_backward = unsharded_before_reduce
    try:
        result = train(load_recipe(TINY, [*overrides, "train.steps=1"]))
    finally:
        hook.remove()
        FSDPModule.finalize_backward = finalize
    params = list(result.objective.parameters())
    captured["parameters"] = sum(local(p).numel() * p.dtype.itemsize for p in params)
    optimizer = result.optimizer
    captured["optimizer"] = sum(
        local(v).numel() * v.dtype.itemsize
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    captured["rank"] = dist.get_rank()
    return captured


def saved_activation_bytes(overrides) -> dict[str, int]:
    """Bytes the training objective's forward saves for the backward on this rank, for the tiny
    layout ``overrides`` on step 0's batch (:func:`qwen35_trainer.plan.measured.
    saved_activation_bytes`)."""
    from qwen35_trainer.plan.measured import saved_activation_bytes as measure

    return measure(load_recipe(TINY, overrides))


def load_peak_rss(overrides, weights: str, window: int) -> dict[str, int]:
    """This rank's peak RSS increase while ``load_hf_weights`` fills its (allocated, untouched)
    shards from ``weights``, with the bytes it holds and its largest local slice."""
    import math

    import torch

    from qwen35_trainer import build_training_model, load_hf_weights
    from qwen35_trainer.model.build import materialize_buffers
    from qwen35_trainer.model.weights.shards import local_index
    from qwen35_trainer.plan.memory import parameter_bytes

    r = load_recipe(TINY, overrides)
    model = build_training_model(r, torch.device("cpu"), materialize=False)[0].model
    model.to_empty(device="cpu")
    materialize_buffers(model, "cpu")
    largest = max(math.prod(len(i) for i in local_index(p)) * 4 for p in model.parameters())
    with host_memory() as used:
        load_hf_weights(model, weights, window_bytes=window)
    return {
        "rank": dist.get_rank(),
        "increase": used.peak,
        "shards": parameter_bytes(model),
        "largest_slice": largest,
    }


# The dataset runs: the demo dataset, 4 packed rows of 128 tokens per step.
DATASET = (
    "data.global_batch=4",
    "data.pack_length=128",
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "model.expert_backend=torch",
    "train.eps=0.001",
)


def check_dataset_layout_equals_one_process(
    root, overrides, reference_logs, reference_state, fields=FIELDS
) -> None:
    """The layout ``overrides`` on the demo dataset equals one process: the loader gives every
    layout the same global step (its rows are dealt to the data ranks). ``fields``: the logged
    values compared (the aux loss is per micro-batch: not with accumulation)."""
    result = train(demo_recipe(root, *DATASET, *overrides))
    assert_same_run(
        result.logs,
        reference_logs,
        result.objective.model.state_dict(),
        reference_state,
        fields=fields,
    )
    assert result.logs[0].fill == reference_logs[0].fill


def check_dataset_resume(root, path, reference_logs, reference_state) -> None:
    """Stopped after 1 step of a DP 2 run and started again: the loader's cursors come back
    from the checkpoint, and steps 2..3 equal the uninterrupted one-process run."""
    first = train(
        demo_recipe(
            root, *DATASET, "parallel.dp=2", "train.steps=1", f"train.checkpoint_dir={path}"
        )
    )
    assert [log.step for log in first.logs] == [1]
    result = train(demo_recipe(root, *DATASET, "parallel.dp=2", f"train.checkpoint_dir={path}"))
    assert_same_run(
        result.logs, reference_logs[1:], result.objective.model.state_dict(), reference_state
    )


def check_bad_row_raises_on_every_rank(root) -> str:
    """Position 3 of the stream is bad; it is shard 3's, so only rank 1 (of DP 2) reads it:
    rank 1 raises its message, rank 0 raises naming rank 1 — neither waits in a collective."""
    from qwen35_trainer.data.conversation import DataError

    recipe = demo_recipe(
        root,
        *DATASET,
        "parallel.dp=2",
        "data.path=null",
        "data.source=data_source:with_bad_row",
        "data.pack_length=64",
    )
    try:
        train(recipe)
    except DataError as error:
        message = str(error)
    else:
        raise AssertionError("the bad row was not reported")
    if dist.get_rank() == 1:
        assert "data_source:with_bad_row:3: missing media file" in message, message
    else:
        assert "bad data on rank(s) [1]" in message, message
    return message


def check_nonfinite_stops_every_rank(root, source) -> None:
    """DP 2 on the demo dataset, the document ``source`` of step 3 (read by rank 1 only) with
    NaN pixels: every rank stops at step 3 without applying it, naming that document (the
    loss and gradient norm are global, so no rank steps while another stops)."""
    from helpers import nan_pixels

    from qwen35_trainer.train.nonfinite import NonFiniteStep

    try:
        with nan_pixels(source):
            train(demo_recipe(root, *DATASET, "parallel.dp=2"))
    except NonFiniteStep as error:
        assert str(error).startswith("step 3: loss nan"), error
        assert source in error.sources, (source, error.sources)
        assert [log.step for log in error.result.logs] == [1, 2, 3]
    else:
        raise AssertionError("the non-finite step was not reported")


REPEATED = (
    "step",
    "loss",
    "ce",
    "aux",
    "grad_norm",
    "tokens",
    "eval_loss",
    "eval_accuracy",
    "fill",
    "expert_load_max_over_mean",
    "cp_imbalance",
)


def check_runs_repeat(root, overrides) -> None:
    """The tiny recipe as it is (4 ranks: DP 2 x CP 2 with EP 2, its demo dataset) run twice:
    every logged number of every step in metrics.jsonl and the final checkpoint's shard files
    (weights and optimizer state, by their checksums) are equal bit for bit."""
    runs = []
    for name in ("first", "second"):
        out = Path(root) / name
        train(
            load_recipe(
                TINY,
                [
                    "train.steps=2",
                    "train.eval_every=2",
                    "train.eval_steps=1",
                    "train.checkpoint_every=2",
                    f"train.output_dir={out}",
                    *overrides,
                ],
            )
        )
        dist.barrier()  # rank 0 has closed the run folder
        records = step_records(out / "metrics.jsonl")
        metrics = [{k: record[k] for k in REPEATED} for record in records]
        files = json.loads((out / "checkpoints" / "step_000002" / "manifest.json").read_text())
        shards = {n: r["checksum"] for n, r in files["files"].items() if n.endswith(".distcp")}
        runs.append((metrics, shards))
    assert len(runs[0][0]) == 2 and len(runs[0][1]) == 2 * dist.get_world_size()  # 2 per rank
    assert runs[0] == runs[1], runs


def check_async_tp_equals_one_process(
    overrides, reference_logs, reference_state, compare=None
) -> dict[str, int]:
    """``parallel.async_tp=true`` (TP 2 + SP, compiled blocks) trained on these CPU ranks equals
    one process, with Inductor's micro-pipeline TP pass rewriting the blocks' graphs and the
    fused ops running (:func:`dist_testkit.cpu_micro_pipeline_tp`: the pass's NCCL and
    symmetric-memory checks pass, the fused ops run torch's reference kernels). Two more things
    a GPU provides are stood in for: the machine check says async TP runs here, and
    ``enable_async_tp`` (whose CUDA / NCCL / symmetric-memory checks async-tp-linear tests)
    only turns the pass on, its last line.

    What must fuse: in the forward every matmul -> reduce-scatter (the row-parallel
    ``o_proj``, shared-expert ``down_proj`` and Gated DeltaNet ``out_proj``) and the shared
    expert's all-gather -> ``gate_proj`` / ``up_proj``; in the backward the all-gather of a
    row-parallel output's gradient -> its matmuls. What does not (README, "What async TP
    fuses"): the attention's and the Gated DeltaNet's input all-gathers, which a graph break
    inside the module (its eager varlen kernel) leaves in another graph than the projections,
    and most backward reduce-scatters. This rank's counts: each (graph, kind, status, reason) of
    the collective sites after the pass, and the fused kernels' calls."""
    from collections import Counter
    from unittest import mock

    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.fx_passes import micro_pipeline_tp, post_grad

    import async_tp_linear
    from qwen35_trainer.parallel import apply

    def turn_the_pass_on(tp_mesh, *, sequence_parallel):
        assert sequence_parallel
        inductor_config._micro_pipeline_tp = True

    sites = Counter()
    the_pass = post_grad.micro_pipeline_tp_pass

    def recorded_pass(graph):
        the_pass(graph)
        graph_kind = "backward" if micro_pipeline_tp._is_backward(graph) else "forward"
        for site in async_tp_linear.find_fusion_patterns(graph):
            sites[(graph_kind, site.kind, site.status, site.reason)] += 1

    torch._dynamo.reset()  # no graph compiled by an earlier layout without the pass
    with (
        inductor_config.patch(_micro_pipeline_tp=False),  # off again on exit
        cpu_micro_pipeline_tp() as calls,  # which compiles every graph (no cache)
        mock.patch.object(async_tp_linear, "async_tp_refusal", lambda device_type: None),
        mock.patch.object(apply, "enable_async_tp", turn_the_pass_on),
        mock.patch.object(post_grad, "micro_pipeline_tp_pass", recorded_pass),
    ):
        check_training_equals_one_process(
            ("parallel.async_tp=true", *overrides), reference_logs, reference_state, compare
        )
    torch._dynamo.reset()
    forward_scatters = {key for key in sites if key[:2] == ("forward", "matmul_reduce_scatter")}
    assert forward_scatters == {("forward", "matmul_reduce_scatter", "fused", "")}, sites
    for graph_kind in ("forward", "backward"):
        assert sites[(graph_kind, "all_gather_matmul", "fused", "")] > 0, (graph_kind, sites)
    assert all(calls[op] > 0 for op in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"))
    return {**calls, **{" / ".join(key).rstrip(" /"): n for key, n in sorted(sites.items())}}
