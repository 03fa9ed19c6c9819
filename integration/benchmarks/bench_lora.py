"""LoRA: what it costs and what it saves, in one run.

1. A training step with LoRA (``model.lora``: rank 16 on every projection and the routed
   experts, the base frozen) against full fine-tuning of the same model: a Qwen3.5 MoE-VLM with
   the tiny recipe's layout at hidden 256, 64 experts of width 256, one process, fp32 CPU,
   synthetic rows. Step time (median of steps 2..4) and the peak host memory the run adds
   (RSS high-water mark over the run, the model build included: the gradients and AdamW moments
   of every weight are what LoRA drops).
2. The routed experts' adapters, forward + backward of one MoE layer's experts (64 experts,
   hidden 512, width 256, rank 16, 2,048 tokens top-8, fp32 CPU):
   - ``moe-parallel``: the grouped adapters inside the grouped expert computation
     (``add_expert_lora``): two grouped GEMMs through the rank per projection;
   - ``peft``: PEFT's ``target_parameters`` LoRA on transformers' ``Qwen3_5MoeExperts`` (the
     best installable peer): it forms every expert's delta ``[E, out, in]`` each forward;
   - ``naive``: a per-expert loop over merged weights ``W_e + s · B_e A_e``.
   Time (median of 5 after the first), the peak memory the first forward + backward adds
   (later ones reuse the heap the first grew, so their RSS does not move) and the bytes the
   forward saves for the backward (autograd's saved tensors, parameters and input left out:
   the memory measure the allocator does not blur).

Each measurement runs in a fresh subprocess (peak RSS is per process).

    python benchmarks/bench_lora.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

MIB = 1 << 20
SIZE = (
    "model.text.hidden_size=256",
    "model.text.num_experts=64",
    "model.text.moe_intermediate_size=256",
    "model.text.shared_expert_intermediate_size=256",
    "model.text.head_dim=64",
    "model.text.linear_key_head_dim=64",
    "model.text.linear_value_head_dim=64",
    "model.vision.out_hidden_size=256",
)
E, H, INTER, R, TOKENS, K = 64, 512, 256, 16, 2048, 8


def _step(lora: bool) -> dict:
    import torch

    from dist_testkit import host_memory
    from qwen35_trainer import load_recipe, train

    torch.set_num_threads(1)
    sets = [
        "parallel.dp=1",
        "parallel.cp=1",
        "parallel.ep=1",
        "data.path=null",
        "data.processor=null",
        "data.eval_path=null",
        "train.eval_every=0",
        "train.steps=4",
        "model.expert_backend=torch",
        *SIZE,
        *(["model.lora.rank=16", "model.lora.alpha=32"] if lora else []),
    ]
    recipe = load_recipe("tiny", sets)
    with host_memory() as used:
        logs = train(recipe).logs
    return {"seconds": statistics.median(log.seconds for log in logs[1:]), "peak": used.peak}


def _experts(variant: str) -> dict:
    import torch
    import torch.nn.functional as F

    from dist_testkit import host_memory

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, H, generator=g)
    top_i = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(TOKENS)])
    top_w = torch.softmax(torch.randn(TOKENS, K, generator=g), -1)
    gate_up = 0.02 * torch.randn(E, 2 * INTER, H, generator=g)
    down = 0.02 * torch.randn(E, H, INTER, generator=g)
    scale = 2.0
    if variant == "moe-parallel":
        from moe_parallel import LoRASpec, add_expert_lora
        from moe_parallel.moe import Experts

        module = Experts(H, E, INTER, backend="torch")
        with torch.no_grad():
            module.gate_up_proj.copy_(gate_up)
            module.down_proj.copy_(down)
        add_expert_lora(module, LoRASpec(R, scale * R))
        module.gate_up_proj.requires_grad_(False)
        module.down_proj.requires_grad_(False)

        def run():
            return (module(x, top_i) * top_w.unsqueeze(-1)).sum(1)

        trained = [p for p in module.parameters() if p.requires_grad]
    elif variant == "peft":
        import transformers
        from peft import LoraConfig, get_peft_model

        config = transformers.Qwen3_5MoeTextConfig(
            hidden_size=H, num_experts=E, moe_intermediate_size=INTER, num_experts_per_tok=K
        )

        class Holder(torch.nn.Module):  # PEFT targets a parameter of a submodule
            def __init__(self):
                super().__init__()
                self.experts = (
                    transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeExperts(config)
                )

            def forward(self, x):
                return self.experts(x, top_i, top_w)

        holder = Holder()
        with torch.no_grad():
            holder.experts.gate_up_proj.copy_(gate_up)
            holder.experts.down_proj.copy_(down)
        lora = LoraConfig(
            r=R, lora_alpha=scale * R, target_modules=[],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        )  # fmt: skip
        model = get_peft_model(holder, lora)

        def run():
            return model(x)

        trained = [p for p in model.parameters() if p.requires_grad]
    else:
        a_gu = torch.empty(E, R, H).uniform_(-0.04, 0.04).requires_grad_()
        b_gu = torch.zeros(E, 2 * INTER, R, requires_grad=True)
        a_d = torch.empty(E, R, INTER).uniform_(-0.06, 0.06).requires_grad_()
        b_d = torch.zeros(E, H, R, requires_grad=True)

        def run():
            out = torch.zeros_like(x)
            for e in range(E):
                token, slot = (top_i == e).nonzero(as_tuple=True)
                w_gu = gate_up[e] + scale * b_gu[e] @ a_gu[e]
                w_d = down[e] + scale * b_d[e] @ a_d[e]
                gate, up = F.linear(x[token], w_gu).chunk(2, -1)
                y = F.linear(F.silu(gate) * up, w_d) * top_w[token, slot, None]
                out = out.index_add(0, token, y)
            return out

        trained = [a_gu, b_gu, a_d, b_d]

    def step():
        torch.autograd.grad(run().square().sum(), trained)

    with host_memory() as used:  # the first step: the heap has not grown yet
        step()
    saved, kept = {}, {t.untyped_storage().data_ptr() for t in (x, top_w, gate_up, down)}
    kept |= {t.untyped_storage().data_ptr() for t in trained}

    def count(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in kept:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        out = run()
    del out
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak": used.peak, "saved": sum(saved.values())}


def _measure(kind: str, variant: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, variant],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    print("1. a training step, LoRA vs full fine-tuning (hidden 256, 64 experts, one process)")
    print(f"{'':18} {'step s':>8} {'peak MiB':>10} {'time ratio':>11} {'memory ratio':>13}")
    full = _measure("step", "full")
    for name in ("full", "lora"):
        got = full if name == "full" else _measure("step", name)
        print(
            f"{name:18} {got['seconds']:8.3f} {got['peak'] / MIB:10.1f} "
            f"{got['seconds'] / full['seconds']:11.2f} {got['peak'] / full['peak']:13.2f}"
        )
    print(f"\n2. routed-expert LoRA, forward + backward ({E} experts, H {H}, I {INTER}, r {R}, "
          f"{TOKENS} tokens top-{K})")  # fmt: skip
    print(f"{'':18} {'time s':>8} {'peak MiB':>10} {'saved MiB':>10} {'vs ours time':>13} "
          f"{'vs ours peak':>13} {'vs ours saved':>14}")  # fmt: skip
    ours = _measure("experts", "moe-parallel")
    for name in ("moe-parallel", "peft", "naive"):
        got = ours if name == "moe-parallel" else _measure("experts", name)
        print(
            f"{name:18} {got['seconds']:8.3f} {got['peak'] / MIB:10.1f} "
            f"{got['saved'] / MIB:10.1f} {got['seconds'] / ours['seconds']:13.2f} "
            f"{got['peak'] / ours['peak']:13.2f} {got['saved'] / ours['saved']:14.2f}"
        )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        kind, variant = sys.argv[2], sys.argv[3]
        result = _step(variant == "lora") if kind == "step" else _experts(variant)
        print(json.dumps(result))
    else:
        main()
