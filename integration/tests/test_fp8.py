"""The frozen base in FP8 (``model.base_dtype``, FP8 checkpoints), one process, against
independent references: checkpoints in Qwen's FP8 format written here by a block-by-block loop
(blocks of 12 × 12, which divide none of the tiny model's dimensions, and one all-zero block;
:mod:`fp8_fixtures`), their hand-dequantized fp32 copies loaded by transformers itself, and the
trainer's own LoRA on those copies."""

from __future__ import annotations

import pytest
import torch
import transformers
from fp8_fixtures import (
    CONVERTED,
    ZERO_BLOCK,
    dequantized_copy,
    edited_copy,
    export_base,
    fp8_checkpoint,
    quantize_by_hand,
)
from helpers import hf_forward, tiny
from safetensors.torch import load_file

from qwen35_trainer import build_model
from qwen35_trainer.cli import main
from qwen35_trainer.data import global_batch
from qwen35_trainer.model.lora.adapters import is_adapter

BLOCK = (12, 12)
LORA = "model.lora={rank: 4, alpha: 8, expert_rank: 8}"
PACKED = ("data.packing=true", "model.mtp_layers=1")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``(bf16 base, its FP8 version, the FP8 version dequantized by hand in fp32)``."""
    root = tmp_path_factory.mktemp("fp8")
    base = export_base(root / "base")
    fp8 = fp8_checkpoint(root / "fp8", base, BLOCK)
    return base, fp8, dequantized_copy(root / "dequantized", fp8)


def _recipe(path, *more):
    return tiny(f"model.path={path}", *PACKED, *more)


def _on_disk(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _runtime_fp8(model):
    """``{name: (fp8 bytes, fp32 scales)}`` of every weight the model holds in FP8."""
    params = dict(model.named_parameters())
    return {
        name: (param, params[f"{name}_scale_inv"])
        for name, param in params.items()
        if param.dtype == torch.float8_e4m3fn
    }


def _expected(disk, name, scale_dtype=None):
    """The runtime FP8 weight ``name`` as the disk holds it: per-expert tensors stacked, the
    gate's rows (and block rows) before the up's."""
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
        base, proj = name.rsplit(".", 1)
        parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
        experts = sorted({int(k.split(".")[-3]) for k in disk if k.startswith(f"{base}.")})
        keys = [[f"{base}.{e}.{p}.weight" for p in parts] for e in experts]
        data = torch.stack([torch.cat([disk[k].view(torch.uint8) for k in ks]) for ks in keys])
        scale = torch.stack([torch.cat([disk[f"{k}_scale_inv"] for k in ks]) for ks in keys])
        return data, scale
    return disk[name].view(torch.uint8), disk[f"{name}_scale_inv"]


def test_an_fp8_checkpoint_is_held_as_stored(checkpoints):
    _, fp8, _ = checkpoints
    model = build_model(_recipe(fp8, LORA).model)
    disk, held = _on_disk(fp8), _runtime_fp8(model)
    converted = {k for k in disk if CONVERTED.match(k)}
    # 3 Gated DeltaNet layers (3 + 3 shared-expert projections + 2 expert weights), the
    # attention layer and the MTP layer (4 + 3 + 2)
    assert len(held) == 3 * 8 + 2 * 9
    assert any(k.endswith(".experts.3.up_proj.weight") for k in converted)
    for name, (data, scale) in held.items():
        want_data, want_scale = _expected(disk, name)
        assert torch.equal(data.view(torch.uint8), want_data), name
        assert scale.dtype == torch.float32 and torch.equal(scale, want_scale.float()), name
        assert not data.requires_grad and not scale.requires_grad
    zero_scale = dict(model.named_parameters())[f"{ZERO_BLOCK}_scale_inv"]
    zero = dict(model.named_parameters())[ZERO_BLOCK][:12, :12]
    assert zero_scale[0, 0] == 1 and torch.all(zero.float() == 0)
    # the bytes of the converted modules: FP8 + fp32 scales + adapters, nothing else (every
    # tensor a module holds, parameters, buffers and attributes alike)
    checked = 0
    for module_name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not any(p.dtype == torch.float8_e4m3fn for p in own.values()):
            continue
        held_bytes = sum(t.numel() * t.element_size() for t in _tensors_held(module))
        want = sum(
            p.numel() * (1 if p.dtype == torch.float8_e4m3fn else 4)
            for n, p in own.items()
            if p.dtype == torch.float8_e4m3fn
            or n.endswith("_scale_inv")
            or is_adapter(f"{module_name}.{n}")
        )
        assert held_bytes == want == sum(p.numel() * p.element_size() for p in own.values())
        checked += sum(p.dtype == torch.float8_e4m3fn for p in own.values())
    assert checked == len(held)


def _tensors_held(module):
    """Every tensor ``module`` itself holds (parameters, buffers, plain attributes)."""
    held = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    held += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return {id(t): t for t in held}.values()


def _set_adapters(model, seed=3):
    """Random adapters (B too), the same for every model given the same seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if is_adapter(name):
                param.copy_(0.2 * torch.randn(param.shape, generator=g))


def _logits_and_grads(model, recipe):
    """Logits of step 1's batch, and the gradients of a fixed function of them w.r.t. every
    adapter and the token embeddings' output."""
    batch = global_batch(recipe.model, recipe.data, 0, step=1, dp=1)
    embedded = []

    def keep(module, inputs, output):  # the embeddings as a leaf: their gradient is the input's
        leaf = output.detach().requires_grad_()
        embedded.append(leaf)
        return leaf

    hook = model.get_input_embeddings().register_forward_hook(keep)
    logits = hf_forward(model, batch).logits
    hook.remove()
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
    (logits * weights).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if is_adapter(n)}
    return logits.detach(), grads, embedded[0].grad


def test_logits_and_gradients_equal_the_dequantized_model(checkpoints):
    _, fp8, dequantized = checkpoints
    ours_recipe = _recipe(fp8, LORA)
    ours = build_model(ours_recipe.model)
    theirs = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(dequantized)
    batch = global_batch(ours_recipe.model, ours_recipe.data, 0, step=1, dp=1)
    with torch.no_grad():  # B = 0: the base, against transformers on the dequantized weights
        torch.testing.assert_close(
            hf_forward(ours, batch).logits, hf_forward(theirs, batch).logits, rtol=1e-5, atol=1e-6
        )
    reference = build_model(_recipe(dequantized, LORA).model)  # the same adapters, float base
    for model in (ours, reference):
        _set_adapters(model)
    got, want = _logits_and_grads(ours, ours_recipe), _logits_and_grads(reference, ours_recipe)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[1].keys() == want[1].keys() and len(got[1]) > 50
    for name, grad in got[1].items():
        torch.testing.assert_close(grad, want[1][name], rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)


def test_quantize_on_load_equals_the_block_loop(checkpoints):
    base, _, _ = checkpoints
    model = build_model(
        _recipe(base, LORA, "model.base_dtype=fp8", "model.fp8_block=[12, 12]").model
    )
    disk, held = _on_disk(base), _runtime_fp8(model)
    assert len(held) == 3 * 8 + 2 * 9
    quantized = {}
    for key in (k for k in disk if CONVERTED.match(k)):
        data, scale = quantize_by_hand(disk[key], BLOCK, torch.float32)
        quantized[key], quantized[f"{key}_scale_inv"] = data, scale
    for name, (data, scale) in held.items():
        want_data, want_scale = _expected(quantized, name)
        assert torch.equal(data.view(torch.uint8), want_data), name
        assert torch.equal(scale, want_scale), name


def test_full_fine_tuning_dequantizes_an_fp8_checkpoint(checkpoints):
    _, fp8, dequantized = checkpoints
    ours = build_model(_recipe(fp8).model)
    theirs = build_model(_recipe(dequantized).model)
    assert not _runtime_fp8(ours)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b), name


def _exit_and_message(capsys, sets):
    code = main(["tiny", *(a for s in sets for a in ("--set", s))])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("scale_shape", r"in_proj_z.weight_scale_inv: BF16 \[2, 3\] on disk, a float \[3, 3\] "
                        r"expected for .*in_proj_z.weight \[32, 32\] in blocks of \[12, 12\]"),
        ("fmt", r"model.quantization.fmt must be 'e4m3' \(float8_e4m3fn\), got 'e5m2'"),
        ("no_scale", r"layers.3.self_attn.q_proj.weight: F8_E4M3 on disk without its scale"),
        ("no_config", r"\d+ tensor\(s\) are F8_E4M3 on disk \(e.g. [\w.]+\) but its "
                      r"config.json has no quantization_config"),
        ("integer", r"layers.0.input_layernorm.weight: dtype I32 on disk, a float"),
        ("bare_fp8", r"\d+ tensor\(s\) are F8_E4M3 on disk \(e.g. [\w.]+\) but its "
                     r"config.json has no quantization_config"),
    ],
)  # fmt: skip
def test_a_bad_fp8_checkpoint_exits_2_naming_the_tensor(
    checkpoints, tmp_path, capsys, fault, message
):
    _, fp8, _ = checkpoints
    layer = "model.language_model.layers."

    def tensors(t):
        if fault == "scale_shape":
            key = f"{layer}0.linear_attn.in_proj_z.weight_scale_inv"
            t[key] = t[key][:2]
        elif fault == "no_scale":
            del t[f"{layer}3.self_attn.q_proj.weight_scale_inv"]
        elif fault == "bare_fp8":  # FP8 bytes without scales or config: not read as values
            for key in [k for k in t if k.endswith("_scale_inv")]:
                del t[key]
        elif fault == "integer":
            t[f"{layer}0.input_layernorm.weight"] = t[f"{layer}0.input_layernorm.weight"].int()

    def config(c):
        if fault == "fmt":
            c["quantization_config"]["fmt"] = "e5m2"
        elif fault in ("no_config", "bare_fp8"):
            del c["quantization_config"]

    bad = edited_copy(tmp_path / fault, fp8, tensors, config)
    sets = ["parallel.dp=1", "parallel.cp=1", "parallel.ep=1", "data.path=null",
            "data.processor=null", "data.eval_path=null", "train.steps=1", "train.eval_every=0",
            f"model.path={bad}", LORA, *PACKED]  # fmt: skip
    code, err = _exit_and_message(capsys, sets)
    assert code == 2, err
    assert "Traceback" not in err
    import re

    assert re.search(message, err), err
    if fault in ("no_config", "bare_fp8"):
        assert err.count("F8_E4M3") == 1, err  # one message, not one per tensor


def test_fp8_without_lora_is_refused(checkpoints, capsys):
    base, _, _ = checkpoints
    sets = ["parallel.dp=1", "parallel.cp=1", "parallel.ep=1", f"model.path={base}",
            "model.base_dtype=fp8"]  # fmt: skip
    code, err = _exit_and_message(capsys, sets)
    assert code == 2 and "model.base_dtype=fp8 needs model.lora" in err, err


@pytest.fixture(scope="module")
def trained(checkpoints, tmp_path_factory):
    """3 steps of LoRA on the FP8 checkpoint, checkpointed."""
    from qwen35_trainer import train

    _, fp8, _ = checkpoints
    ckpt = tmp_path_factory.mktemp("fp8_ckpt")
    sets = (LORA, "train.steps=3", f"train.checkpoint_dir={ckpt}", "model.lora.alpha=64")
    recipe = _recipe(fp8, *sets)
    return recipe, train(recipe), ckpt, sets


def _export(recipe_sets, fp8, ckpt, out, *flags):
    sets = ["parallel.dp=1", "parallel.cp=1", "parallel.ep=1", "data.path=null",
            "data.processor=null", "data.eval_path=null", f"model.path={fp8}", *PACKED,
            *recipe_sets]  # fmt: skip
    return main(["export", "tiny", *(a for s in sets for a in ("--set", s)), str(ckpt), str(out),
                 *flags])  # fmt: skip


def test_merged_exports_dequantize_or_requantize(checkpoints, trained, tmp_path):
    import json

    from fp8_fixtures import dequantize_by_hand
    from served_fields import check_served_fields

    _, fp8, _ = checkpoints
    recipe, result, ckpt, sets = trained
    state = result.state_dict()
    # bf16 by default (the source's dtype); float32 on request: transformers loads it and
    # computes the trained model's logits
    assert _export(sets, fp8, ckpt, tmp_path / "bf16", "--lora", "merged") == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert _export(sets, fp8, ckpt, tmp_path / "f32", "--lora", "merged", "--dtype", "float32") == 0
    loaded = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "f32")
    trained_model = build_model(recipe.model)
    trained_model.load_state_dict(state)
    batch = global_batch(recipe.model, recipe.data, 0, step=5, dp=1)
    with torch.no_grad():
        torch.testing.assert_close(
            hf_forward(loaded, batch).logits,
            hf_forward(trained_model, batch).logits,
            rtol=1e-5,
            atol=1e-5,  # W x + s B (A x) against (W + s B A) x
        )
    # FP8: quantize(dequantize(W) + s · B A) in the source's blocks and scale dtype, per expert
    assert _export(sets, fp8, ckpt, tmp_path / "fp8", "--lora", "merged", "--dtype", "fp8") == 0
    written, source = _on_disk(tmp_path / "fp8"), _on_disk(fp8)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    source_config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"] == source_config["quantization_config"]
    check_served_fields(config, result.objective.model.config)  # what vLLM / SGLang read
    assert set(written) == set(source)  # the source's tensors, names and layout
    scales = {"dense": 64 / 4, "experts": 64 / 8}  # alpha / rank, alpha / expert_rank
    checked = 0
    for key, value in source.items():
        if value.dtype != torch.float8_e4m3fn:
            assert written[key].dtype == torch.bfloat16, key
            continue
        base = dequantize_by_hand(value, source[f"{key}_scale_inv"], BLOCK)
        module, _ = key.rsplit(".", 1)
        if key.startswith("mtp."):  # the MTP head has no adapters
            want_data, want_scale = value, source[f"{key}_scale_inv"]
            assert torch.equal(written[key].view(torch.uint8), want_data.view(torch.uint8)), key
            assert torch.equal(written[f"{key}_scale_inv"], want_scale), key
            checked += 1
            continue
        parent, expert, proj = module.rsplit(".", 2) if ".experts." in key else (module, None, None)
        if expert is None:
            delta = scales["dense"] * state[f"{module}.lora_B"] @ state[f"{module}.lora_A"]
        else:
            part = "down" if proj == "down_proj" else "gate_up"
            e = int(expert)
            b, a = state[f"{parent}.lora_{part}_B"], state[f"{parent}.lora_{part}_A"]
            delta = scales["experts"] * torch.bmm(b, a)[e]
            rows = base.shape[0]
            delta = delta[rows:] if proj == "up_proj" else delta[:rows]
        want_data, want_scale = quantize_by_hand(base + delta, BLOCK)
        assert torch.equal(written[key].view(torch.uint8), want_data.view(torch.uint8)), key
        assert torch.equal(written[f"{key}_scale_inv"], want_scale), key
        checked += 1
    assert checked == len([k for k in source if k.endswith("_scale_inv")])


def test_the_peft_export_names_the_fp8_checkpoint(checkpoints, trained, tmp_path):
    import json

    _, fp8, _ = checkpoints
    _, _, ckpt, sets = trained
    assert _export(sets, fp8, ckpt, tmp_path / "peft") == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(fp8)


def test_lora_on_the_fp8_base_learns_like_on_the_bf16_base(checkpoints, tmp_path):
    """20 bf16 steps of LoRA on the demo conversations from the bf16 checkpoint, its frozen
    base held in bf16 or quantized on load to FP8 (blocks of 16, which divide every dimension):
    both learn, and the FP8 run's loss stays within 2 % of the bf16 run's at every step."""
    from helpers import demo_recipe

    from qwen35_trainer import train
    from qwen35_trainer.demo.dataset import make_demo

    base, _, _ = checkpoints
    demo = make_demo(tmp_path / "demo", train_rows=200, heldout_rows=8)
    sets = (f"model.path={base}", "model.lora={rank: 8, alpha: 64}", "train.steps=20",
            "train.dtype=bfloat16", "model.mtp_layers=1", "train.eval_every=0")  # fmt: skip
    bf16 = [log.loss for log in train(demo_recipe(demo, *sets)).logs]
    fp8 = [
        log.loss
        for log in train(
            demo_recipe(demo, *sets, "model.base_dtype=fp8", "model.fp8_block=[16, 16]")
        ).logs
    ]
    for losses in (bf16, fp8):
        assert sum(losses[-5:]) / 5 < losses[0] - 0.2, losses  # both learn
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(fp8, bf16, strict=True)), (fp8, bf16)


def test_the_run_says_what_the_base_is_held_in(checkpoints):
    from qwen35_trainer.model.kernels import resolve_kernels
    from qwen35_trainer.supervise.console import what_runs

    base, fp8, _ = checkpoints
    cpu = torch.device("cpu")

    def lines(recipe, world=1):
        return "\n".join(what_runs(recipe, world, cpu, resolve_kernels(recipe, "cpu")))

    held = lines(_recipe(fp8, LORA))
    assert "frozen base: FP8 e4m3 in blocks of [12, 12] (as the checkpoint stores it)" in held
    assert "frozen base FP8 blocks dequantized per use" in held and "no FP8 GEMM path" in held
    assert "unsharded (one LoRA process" in held
    quantized = lines(_recipe(base, LORA, "model.base_dtype=fp8"), world=2)
    assert "blocks of [128, 128] (quantized on load)" in quantized and "FSDP2" in quantized
    assert "dequantized into the float32 master weights" in lines(_recipe(fp8))
    assert "frozen base: float32" in lines(_recipe(base, LORA))
    assert resolve_kernels(_recipe(fp8, LORA), "cpu").record()["frozen base"] == "dequantize"
