"""cp-vision's agreement all-reduce uses a tensor on the group's device (NCCL needs CUDA
tensors); the gloo launches in test_sharded_gloo.py exercise the CPU side."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_vision.shard import group_device


@pytest.mark.parametrize(
    ("backend", "device"),
    [("nccl", "cuda:0"), ("cpu:gloo,cuda:nccl", "cpu"), ("gloo", "cpu"), ("fake", "cpu")],
)
def test_group_device_follows_the_backend(monkeypatch, backend, device):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert group_device(None) == torch.device(device)
