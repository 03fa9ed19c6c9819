"""fla prewarm: run the chunked gated-delta-rule kernels forward and backward once per shape.

Each distinct :class:`~setup_prewarm.gdn.GDNShape` of the model runs twice — dense
(``[2, T, H, D]``) and packed (``[1, T, H, D]`` with ``cu_seqlens``) — because fla's Triton
autotuner keys several kernels on whether the input is variable-length. Inputs follow the
transformers Qwen3.5 call: q/k/v and ``beta`` in the layer dtype, the log-decay ``g`` in fp32,
q/k L2-normalised inside the kernel. ``T`` spans several 64-token chunks and the packed
documents end inside a chunk, so the multi-chunk and boundary paths compile too.

fla is imported lazily, only when there is a GPU and a GDN layer: importing it on a CPU-only
machine is what breaks transformers (see the project design notes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from setup_prewarm.gdn import GDNShape, find_gdn_shapes
from setup_prewarm.report import SkipStep

__all__ = ["run_gdn_kernel", "warm_fla"]

SEQ_LEN = 128
PACKED_CU_SEQLENS = (0, 37, SEQ_LEN)


def run_gdn_kernel(
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    shape: GDNShape,
    device: torch.device,
    *,
    packed: bool,
) -> None:
    """Call ``kernel`` (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``'s signature) on
    random inputs of ``shape`` and backpropagate through it.

    Dense: q, k ``[2, T, Hk, Dk]``, v ``[2, T, Hv, Dv]``, g, beta ``[2, T, Hv]``. Packed: the
    same with batch 1 and ``cu_seqlens`` ``[3]`` (two documents). Raises ``RuntimeError`` when
    the output is not ``[B, T, Hv, Dv]`` or an input got no gradient.
    """
    batch = 1 if packed else 2
    lead = (batch, SEQ_LEN)

    def leaf(*size: int, dtype: torch.dtype = shape.dtype) -> torch.Tensor:
        return torch.randn(*lead, *size, device=device, dtype=dtype)

    q = leaf(shape.num_k_heads, shape.head_k_dim).requires_grad_()
    k = leaf(shape.num_k_heads, shape.head_k_dim).requires_grad_()
    v = leaf(shape.num_v_heads, shape.head_v_dim).requires_grad_()
    g = F.logsigmoid(leaf(shape.num_v_heads, dtype=torch.float32)).requires_grad_()
    beta = leaf(shape.num_v_heads).sigmoid().requires_grad_()
    cu_seqlens = (
        torch.tensor(PACKED_CU_SEQLENS, device=device, dtype=torch.long) if packed else None
    )
    out, _ = kernel(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    want = (*lead, shape.num_v_heads, shape.head_v_dim)
    if tuple(out.shape) != want:
        raise RuntimeError(f"gated-delta-rule output is {tuple(out.shape)}, expected {want}")
    out.backward(torch.ones_like(out))
    missing = [n for n, t in zip("qkvgb", (q, k, v, g, beta), strict=True) if t.grad is None]
    if missing:
        raise RuntimeError(f"gated-delta-rule backward left no gradient for {missing}")


def warm_fla(model: nn.Module | None, device: torch.device) -> str:
    """Run fla's chunk kernels for every GDN shape of ``model`` (dense and packed).

    Raises :class:`SkipStep` with the reason when there is no model, no GDN layer, no CUDA
    device or no importable fla; the reason names the shapes it would have warmed.
    """
    if model is None:
        raise SkipStep("no model given")
    shapes = find_gdn_shapes(model)
    if not shapes:
        raise SkipStep("no gated-delta-rule layers in the model")
    listed = "; ".join(map(str, shapes))
    if device.type != "cuda":
        raise SkipStep(f"needs a CUDA device, got {device} (shapes: {listed})")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        raise SkipStep(
            f"fla is not importable ({exc}); install flash-linear-attention (shapes: {listed})"
        ) from exc
    for shape in shapes:
        for packed in (False, True):
            run_gdn_kernel(chunk_gated_delta_rule, shape, device, packed=packed)
    return f"chunk_gated_delta_rule fwd+bwd, dense and packed, for {len(shapes)} shape(s): {listed}"
