"""bf16 training (``train.dtype: bfloat16``): bf16 parameters and compute through FSDP2 mixed
precision, fp32 master weights, fp32 loss statistics; it tracks the fp32 run of the tiny
recipe. (bf16 under CP × EP against one-process bf16: ``bf16_dp2_cp2_ep2`` in
test_train_dp.py.)"""

from __future__ import annotations

import torch
from helpers import tiny

import qwen35_trainer.model.objective as objective_module
from qwen35_trainer import train


def test_bf16_tracks_fp32_over_20_steps():
    """Each of the first 10 steps within 1% of fp32, the last within 5%, and bf16 learns as
    fp32 does. At lr 0.01 the tiny run amplifies rounding differences step after step, and how
    a CPU rounds bf16 products depends on it: with native bf16 dot products (AVX512-BF16) the
    gap measured 0.2% at step 10 and 2.3% at step 20 (it stayed under 2% on a CPU without)."""
    fp32 = train(tiny("train.steps=20")).logs
    bf16 = train(tiny("train.steps=20", "train.dtype=bfloat16")).logs
    assert fp32[-1].loss < 0.8 * fp32[0].loss  # it learns, so the comparison means something
    assert bf16[-1].loss < 0.8 * bf16[0].loss
    for a, b in zip(bf16[:10], fp32[:10], strict=True):
        assert abs(a.loss - b.loss) <= 0.01 * b.loss, (a, b)
    assert abs(bf16[-1].loss - fp32[-1].loss) <= 0.05 * fp32[-1].loss, (bf16[-1], fp32[-1])
    assert any(a.loss != b.loss for a, b in zip(bf16, fp32, strict=True))  # really bf16


def test_bf16_computes_in_bf16_on_fp32_master_weights(monkeypatch):
    seen = {}
    real = objective_module.TrainingObjective.forward

    def forward(self, *args, **kwargs):
        layer = self.model.model.language_model.layers[0].linear_attn.in_proj_qkv
        layer.register_forward_hook(lambda m, i, o: seen.setdefault("compute", o.dtype) and None)
        shares = real(self, *args, **kwargs)
        seen["loss"] = (shares.ce.dtype, shares.aux.dtype)
        return shares

    monkeypatch.setattr(objective_module.TrainingObjective, "forward", forward)
    result = train(tiny("train.steps=1", "train.dtype=bfloat16"))
    assert seen == {"compute": torch.bfloat16, "loss": (torch.float32, torch.float32)}
    dtypes = {getattr(p, "_local_tensor", p).dtype for p in result.objective.parameters()}
    assert dtypes == {torch.float32}
