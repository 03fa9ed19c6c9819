"""LoRA on a frozen base held in FP8 against the same base in bf16, in one run.

1. A bf16 LoRA training step (rank 16 on every projection and the routed experts) of a Qwen3.5
   MoE-VLM with the tiny recipe's layout at hidden 512, 64 experts of width 512, one process,
   CPU, synthetic rows, from one bf16 checkpoint written here (and its FP8 version in Qwen's
   format, blocks of 128):
   - ``bf16 base``: the frozen base held in bf16 (the baseline);
   - ``FP8 base``: ``model.base_dtype: fp8``, quantized on load, dequantized per projection;
   - ``transformers + PEFT``: the best installable peer — transformers loads the FP8
     checkpoint (on a CPU its FP8 integration dequantizes on load) and PEFT adds the same
     adapters (its ``target_parameters`` for the fused experts); the same step with AdamW.
   Step time (median of steps 2..4), the bytes of the parameters held (frozen base + adapters)
   and the peak host memory the run adds (RSS high-water mark, the build included).
2. ``qwen35-train plan --sizes``: the GPUs each public size fine-tunes on, full / LoRA on a
   bf16 base / LoRA on an FP8 base, with the predicted peaks.

Each measurement runs in a fresh subprocess (peak RSS is per process).

    python benchmarks/bench_fp8_base.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1 << 20
SIZE = (
    "model.text.hidden_size=512",
    "model.text.num_experts=64",
    "model.text.moe_intermediate_size=512",
    "model.text.shared_expert_intermediate_size=512",
    "model.text.head_dim=128",
    "model.text.linear_key_head_dim=128",
    "model.text.linear_value_head_dim=128",
    "model.vision.out_hidden_size=512",
    "model.mtp_layers=0",
)
ONE_PROCESS = (
    "parallel.dp=1",
    "parallel.cp=1",
    "parallel.ep=1",
    "data.path=null",
    "data.processor=null",
    "data.eval_path=null",
    "train.eval_every=0",
    "model.expert_backend=torch",
)
LORA = ("model.lora.rank=16", "model.lora.alpha=32")
STEPS = 4


def _checkpoints(root: Path) -> tuple[Path, Path]:
    """The bench model's bf16 checkpoint and its FP8 version (Qwen's format, blocks of 128)."""
    import torch

    from qwen35_trainer import build_model, load_recipe
    from qwen35_trainer.model import export_hf
    from qwen35_trainer.model.weights.export import FP8Export

    model = build_model(load_recipe("tiny", [*ONE_PROCESS, *SIZE]).model)
    export_hf(model, root / "bf16", per_expert=True, dtype=torch.bfloat16)
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}  # fmt: skip
    fp8 = FP8Export((128, 128), torch.bfloat16, config)
    export_hf(model, root / "fp8", per_expert=True, dtype=torch.bfloat16, fp8=fp8)
    return root / "bf16", root / "fp8"


def _ours(path: str, fp8: bool) -> dict:
    from dist_testkit import host_memory
    from qwen35_trainer import load_recipe, train

    sets = [*ONE_PROCESS, *SIZE, *LORA, f"model.path={path}", f"train.steps={STEPS}",
            "train.dtype=bfloat16", *(["model.base_dtype=fp8"] if fp8 else [])]  # fmt: skip
    with host_memory() as used:
        result = train(load_recipe("tiny", sets))
    params = sum(p.numel() * p.element_size() for p in result.objective.model.parameters())
    seconds = statistics.median(log.seconds for log in result.logs[1:])
    return {"seconds": seconds, "peak": used.peak, "params": params}


def _peer(path: str) -> dict:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from dist_testkit import host_memory
    from qwen35_trainer import load_recipe
    from qwen35_trainer.data import global_batch
    from qwen35_trainer.recipe import LORA_TARGETS

    recipe = load_recipe("tiny", [*ONE_PROCESS, *SIZE, f"model.path={path}"])
    with host_memory() as used:
        model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
            path, dtype=torch.bfloat16
        )
        targets = [t for t in LORA_TARGETS if t != "experts"]  # ours: every projection
        config = LoraConfig(r=16, lora_alpha=32, target_modules=targets,
                            target_parameters=["experts.gate_up_proj", "experts.down_proj"])  # fmt: skip
        model = get_peft_model(model, config)
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-4)
        times = []
        for step in range(1, STEPS + 1):
            batch = global_batch(recipe.model, recipe.data, 0, step=step, dp=1)
            start = time.perf_counter()
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        mm_token_type_ids=batch.mm_token_type_ids,
                        pixel_values=batch.pixel_values.bfloat16(),
                        image_grid_thw=batch.image_grid_thw, labels=batch.labels, use_cache=False)  # fmt: skip
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"seconds": statistics.median(times[1:]), "peak": used.peak, "params": params}


def _measure(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        done = subprocess.run(
            [sys.executable, __file__, "--checkpoints", root], capture_output=True, check=True
        )
        assert done.returncode == 0
        bf16, fp8 = Path(root) / "bf16", Path(root) / "fp8"
        print("1. a bf16 LoRA step (hidden 512, 64 experts of 512, rank 16, one process, CPU)")
        print(f"{'':22} {'step s':>8} {'params MiB':>11} {'peak MiB':>10} "
              f"{'time':>6} {'params':>7} {'peak':>6}   (ratios to the bf16 base)")  # fmt: skip
        base = _measure("ours", str(bf16), "bf16")
        rows = {
            "bf16 base": base,
            "FP8 base (ours)": _measure("ours", str(bf16), "fp8"),
            "transformers + PEFT": _measure("peer", str(fp8)),
        }
        for name, got in rows.items():
            print(
                f"{name:22} {got['seconds']:8.3f} {got['params'] / MIB:11.1f} "
                f"{got['peak'] / MIB:10.1f} {got['seconds'] / base['seconds']:6.2f} "
                f"{got['params'] / base['params']:7.2f} {got['peak'] / base['peak']:6.2f}"
            )
    from qwen35_trainer.plan.sizes import size_table

    print("\n2. qwen35-train plan --sizes (80 GiB GPUs)")
    print(size_table())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--checkpoints"]:
        _checkpoints(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["--child"]:
        import torch

        torch.set_num_threads(1)
        kind, path = sys.argv[2], sys.argv[3]
        result = _ours(path, sys.argv[4] == "fp8") if kind == "ours" else _peer(path)
        print(json.dumps(result))
    else:
        main()
