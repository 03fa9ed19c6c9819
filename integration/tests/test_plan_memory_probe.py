"""What a step really allocates (:mod:`qwen35_trainer.plan.memory_probe`): the CPU allocator's
peak seen between ops against tensors of known sizes, and one process's step of the tiny
recipe against the planner's count of the same process (its persistent bytes exactly); and
what the planner counts for an MoE block without checkpointing against the tensors a real
forward saves."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import ONE_PROCESS, SYNTHETIC

from qwen35_trainer import load_recipe
from qwen35_trainer.plan import plan
from qwen35_trainer.plan.memory_probe import MallocPeak, malloc_in_use, measure_peak

MIB = 1 << 20


def test_the_cpu_peak_is_the_tensors_alive_at_once_within_a_block():
    """Two 32 MiB tensors alive together, then freed, then a 4 MiB one: the peak is 64 MiB
    above the start (within 2 MiB of malloc's own bookkeeping and Python's objects), although
    neither is alive when the block ends."""

    def work():
        first = torch.ones(8 * MIB)  # 32 MiB of fp32
        second = first * 2
        del first, second
        torch.ones(MIB)

    start = malloc_in_use()
    mode = MallocPeak()
    with mode:
        work()
    assert 64 * MIB <= mode.peak - start < 66 * MIB
    assert malloc_in_use() - start < 2 * MIB  # all of it given back


def test_one_process_step_of_tiny_against_the_planners_count():
    """The tiny recipe in one process (synthetic rows of a fixed shape, checkpointing on): the
    step starts and ends with the parameters and AdamW's state, which the planner counts
    exactly (plus the model's buffers, which it does not: under 1 %); at its peak it also holds
    the gradients and the step's activations, at least what the planner counts for them once
    the backward's trade of the one for the other is taken off."""
    fixed = ("data.text_tokens=[24, 24]", "data.image_grids=[[1, 8, 8]]")
    recipe = load_recipe("tiny", [*SYNTHETIC, *ONE_PROCESS, *fixed], hub_weights=False)
    counted = plan(recipe).ranks[0]
    peak = measure_peak(recipe, torch.device("cpu"))
    persistent = counted.parameters + counted.optimizer
    assert persistent <= peak.persistent < 1.01 * persistent
    assert peak.reserved is None and peak.fragmentation is None
    held = counted.gradients + counted.activations + counted.freed_for_grads
    assert counted.freed_for_grads < 0 and peak.allocated >= peak.persistent + held


def _wide(*sets: str):
    """tiny at hidden 512 in one process, fed one full 1,024-token row of 8 samples, each image
    of 8 x 8 patches (the rows the planner plans: the benchmark's ``planned_rows``)."""
    widths = ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size")
    return load_recipe(
        "tiny",
        [
            *SYNTHETIC,
            *ONE_PROCESS,
            *(f"model.text.{w}=512" for w in widths),
            "model.vision.out_hidden_size=512",
            "data.pack_length=1024",
            "data.samples_per_rank=8",
            "data.text_tokens=[55, 55]",
            "data.image_grids=[[1, 8, 8]]",
            "train.activation_checkpointing=false",
            *sets,
        ],
        hub_weights=False,
    )


def test_one_micro_batch_holds_the_larger_of_activations_and_gradients():
    """One micro-batch per step: the backward frees each decoder layer's saved tensors as it
    makes that layer's gradients, so a real step never holds the two at once, and the layer in
    its backward holds its gradient unsharded before its shard exists. Measured on tiny at
    hidden 512 without checkpointing (activations and gradients of hundreds of MiB): the peak
    is below the persistent bytes plus both, and the line is ``-(G_dec + U)`` by hand (here
    the decoder's activations exceed its gradients: ``U`` the largest layer's fp32 gradient,
    one process's shard of it the whole); the counted peak is within 5 % of the measured one
    (1.08 while the ``backward`` line counted a block's working set again without
    checkpointing, and 1.07 with this line ``-min(A_dec, G_dec)``: checked to fail so); with
    2 micro-batches the first one's gradients are held through the second's forward, so
    nothing is taken off."""
    from qwen35_trainer.model.build import build_meta_model
    from qwen35_trainer.model.params import named_parameters

    recipe = _wide()
    counted = plan(recipe).ranks[0]
    peak = measure_peak(recipe, torch.device("cpu"))
    both = peak.persistent + counted.activations + counted.gradients
    assert peak.allocated < both
    assert abs(counted.peak / peak.allocated - 1) < 0.05, counted.peak / peak.allocated
    text = recipe.model.text
    decoder_saved = counted.activations - 2 * 64 * 8 * (6 * 32 + 2 * 4304) * 4  # less the tower
    layers: dict[str, int] = {}
    for name, _, _, p in named_parameters(build_meta_model(recipe.model)):
        if name.startswith("model.language_model.layers."):
            layer = name.split(".")[3]
            layers[layer] = layers.get(layer, 0) + p.numel() * 4
    decoder_grads = sum(layers.values())
    assert text["num_hidden_layers"] == 4 and decoder_grads < decoder_saved
    assert counted.freed_for_grads == -(decoder_grads + max(layers.values()))
    assert plan(_wide("train.grad_accum_steps=2")).ranks[0].freed_for_grads == 0


def _moe_saved_bytes(recipe) -> tuple[list[int], list[int]]:
    """``(bytes, tokens)`` per MoE block of one forward of ``recipe`` in one process: the
    storages autograd saves while a block (or a module inside it) runs, each once, the
    parameters as they are at that moment (FSDP's unsharded ones included) left out."""
    from moe_parallel import MoE
    from qwen35_trainer.plan.measured import _storage
    from qwen35_trainer.plan.step_probe import process_group, trainer_step
    from qwen35_trainer.train.step import count_targets

    device = torch.device("cpu")
    with process_group(device):
        step = trainer_step(recipe, device)
        objective, layout = step.objective, step.layout
        blocks = [m for m in objective.modules() if isinstance(m, MoE)]
        saved, tokens, running, seen = [0] * len(blocks), [0] * len(blocks), [], {}
        for n, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda m, a, n=n: running.append(n))
            block.register_forward_hook(lambda m, a, o: running.pop())

        def keep(t):
            address, size = _storage(t)
            params = {_storage(p)[0] for p in objective.parameters()}
            if running and address not in params and address not in seen:
                seen[address] = t  # held: a freed storage's address is not reused meanwhile
                saved[running[-1]] += size
            return t

        def count_tokens(m, args, n):
            tokens[n] = args[0].shape[:-1].numel()

        for n, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda m, a, n=n: count_tokens(m, a, n))
        valid, _ = count_targets(step.micro, layout, device)
        batch, packed = step.micro[0]
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            objective(batch, layout.loss_group, packed, num_valid_tokens=valid)
    return saved, tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_moes_saved_tensors_are_the_planners_count(dtype):
    """Without checkpointing, each MoE block of a real forward (tiny, one process) saves what
    the planner counts per token (:func:`qwen35_trainer.plan.activations.moe_saved`, one process:
    every routed row on this rank) plus its router's input, the post-attention norm's output
    in the compute dtype — within 2 % (the top-k indices and weights it leaves out)."""
    from qwen35_trainer.model.config import build_config
    from qwen35_trainer.plan.activations import moe_saved

    fixed = ("data.text_tokens=[24, 24]", "data.image_grids=[[1, 8, 8]]", f"train.dtype={dtype}")
    recipe = load_recipe("tiny", [*SYNTHETIC, *ONE_PROCESS, *fixed], hub_weights=False)
    recipe = dataclasses.replace(
        recipe, train=dataclasses.replace(recipe.train, activation_checkpointing=False)
    )
    text = build_config(recipe.model).text_config
    b = 2 if dtype == "bfloat16" else 4
    saved, tokens = _moe_saved_bytes(recipe)
    assert len(saved) == text.num_hidden_layers and all(tokens)
    for got, s in zip(saved, tokens, strict=True):
        expected = s * (moe_saved(text, 1.0, b) + text.hidden_size * b)
        assert abs(got - expected) <= 0.02 * expected, (got, expected, s)


def test_a_datasets_images_are_planned_from_the_dataset_and_pp_trades_as_one_process():
    """The demo dataset's images are far larger than tiny's ``image_grids`` (the tower's MLP
    keeps two ``patches × 4,304`` fp32 tensors per block); the planner reads them
    (:mod:`qwen35_trainer.plan.dataset_media`). PP 2 (1F1B, 2 micro-batches) at hidden 512 on
    the demo data, whose first stage holds the tower of both micro-batches in flight: each
    stage's counted peak is within 10 % of the one a real step of that layout measures (stage
    0 read 0.76 when the planner planned ``image_grids``: checked to fail so). In the same
    launch the same layout fed the rows it plans (no images beyond them): its first stage runs
    both forwards before its first backward, which trades one micro-batch's activations for
    the stage's gradients (``StageView.forwards_first``; 1.13 with the trade not taken off:
    checked to fail so)."""
    from qwen35_trainer.plan.memory_probe import rank_peaks_each

    pp = ("parallel.pp=2", "train.grad_accum_steps=2", "train.eval_every=0")
    widths = ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size")
    dataset = load_recipe(
        "tiny",
        [
            *ONE_PROCESS,
            *(f"model.text.{w}=512" for w in widths),
            "model.vision.out_hidden_size=512",
            "data.pack_length=1024",
            "data.samples_per_rank=8",
            *pp,
        ],
        hub_weights=False,
    )
    planned_rows = _wide(*pp, "data.text_tokens=[119, 119]")  # 4 samples fill a 1,024 row
    planned = plan(dataset)
    assert planned.images.startswith("images: the densest micro-batch (2 packed rows) of the ")
    for recipe, measured in zip(
        (dataset, planned_rows), rank_peaks_each([dataset, planned_rows], 2), strict=True
    ):
        counted = plan(recipe).ranks
        ratios = {rank: m.peak / measured[rank].allocated for rank, m in counted.items()}
        assert all(abs(r - 1) < 0.10 for r in ratios.values()), ratios
