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
    fp32 = train(tiny("train.steps=20")).logs
    bf16 = train(tiny("train.steps=20", "train.dtype=bfloat16")).logs
    assert fp32[-1].loss < 0.8 * fp32[0].loss  # it learns, so the comparison means something
    for a, b in zip(bf16, fp32, strict=True):
        assert abs(a.loss - b.loss) <= 0.02 * b.loss, (a, b)
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
