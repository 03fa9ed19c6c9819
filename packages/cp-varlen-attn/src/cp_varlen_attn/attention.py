"""Exact block-diagonal (per-document) causal attention over a CP layout.

Each rank holds the query/key/value rows of its pieces. A query at offset ``i`` of document
``d`` attends to document ``d``'s keys at offsets ``0..i`` (causal) or all of them (not causal),
never to another document's. So a piece ``[s, e)`` needs the keys ``[0, e)`` of its document:
its own rows plus the earlier rows, which :mod:`cp_varlen_attn.exchange` brings from their
owners (differentiably: their gradients return to the owners, summed).

Per piece this is plain attention of ``e - s`` queries over ``e`` keys with a bottom-right
aligned causal mask (query ``j`` of the piece sees keys ``< s + j + 1``):

- ``torch`` backend (CPU or GPU): ``scaled_dot_product_attention`` per piece and per block of
  at most ``QUERY_BLOCK`` queries, with the block's own [block, keys] boolean mask — memory is
  bounded by the block size times the document length, never [S, S];
- ``torch_varlen`` backend (CUDA, bf16/fp16): one call of torch's own ``varlen_attn`` over all
  pieces (each piece a varlen "sequence" whose keys are its document prefix; the Flash kernels
  align causal masks bottom-right when there are more keys than queries, which is exactly this
  mask) — :mod:`cp_varlen_attn.torch_varlen`;
- ``flash`` backend (CUDA, bf16/fp16): the same call to flash-attn's ``flash_attn_varlen_func``.

``auto`` takes ``flash`` where flash-attn is installed, else ``torch_varlen``, on CUDA tensors in
bf16/fp16; else ``torch`` (every CPU run, and CUDA in fp32: a per-piece loop, so slow on a GPU).

Nothing is stored in ambient state: the layout and the group are arguments, so activation
checkpointing's recompute (on the autograd thread) sees exactly what the forward saw. Input
checks are local once the layout object is validated for the group
(:func:`cp_varlen_attn.validate_layout`); the first call with a new layout agrees them.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_varlen_attn.exchange import exchange_rows, plan_exchange
from cp_varlen_attn.layout import CPLayout
from cp_varlen_attn.torch_varlen import (
    HALF_DTYPES,
    flash_pieces,
    torch_varlen_available,
    torch_varlen_pieces,
)
from cp_varlen_attn.validation import check_call

__all__ = ["BACKENDS", "resolve_attention_backend", "varlen_attention"]

BACKENDS = ("auto", "torch", "torch_varlen", "flash")
QUERY_BLOCK = 1024


@torch.compiler.disable  # layout-driven Python: compiled callers run it eagerly
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: CPLayout,
    group: dist.ProcessGroup | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of this rank's queries over their documents' keys.

    Args:
        q: [1, T_local, H_q, D] (or [T_local, H_q, D]) this rank's queries, in layout order
            (``shard_sequence(q_full, layout, rank)``).
        k, v: [1, T_local, H_kv, D] / [1, T_local, H_kv, D_v]; ``H_q`` a multiple of ``H_kv`` (GQA).
        layout: the :class:`CPLayout` of the packed sequence; identical on every rank.
        group: the CP process group (``layout.cp_size`` ranks); ``None`` when ``cp_size == 1``.
    Returns:
        [1, T_local, H_q, D_v] (or [T_local, H_q, D_v]), equal to per-document attention of the
        whole packed sequence, sharded like ``q``.
    """
    squeeze = q.dim() == 3
    rank = dist.get_rank(group) if group is not None else 0
    _validate(q, k, v, layout, group, rank, backend)
    if squeeze:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    q_THD, k_THD, v_THD = q[0], k[0], v[0]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kv_TF = torch.cat([k_THD.flatten(1), v_THD.flatten(1)], dim=1)
    if layout.cp_size > 1:
        plan = plan_exchange(layout, rank, causal)
        kv_RF, row_of = exchange_rows(kv_TF, plan, group), plan.row_of
    else:
        kv_RF, row_of = kv_TF, layout.positions(0).argsort()
    h_kv, d_k = k_THD.shape[1], k_THD.shape[2]
    k_RHD = kv_RF[:, : h_kv * d_k].unflatten(1, (h_kv, d_k))
    v_RHD = kv_RF[:, h_kv * d_k :].unflatten(1, (h_kv, v_THD.shape[2]))
    pieces = _piece_keys(layout, rank, row_of.to(q.device), causal)
    run = _KERNELS[resolve_attention_backend(backend, q.device.type, q.dtype)]
    out_THD = run(q_THD, k_RHD, v_RHD, pieces, scale, causal)
    out = out_THD.unsqueeze(0)
    return out[0] if squeeze else out


def _piece_keys(
    layout: CPLayout, rank: int, row_of: torch.Tensor, causal: bool
) -> list[tuple[int, int, int, torch.Tensor]]:
    """Per local piece: (first local row, length, offset in document, buffer rows of its keys)."""
    out, local = [], 0
    for p in layout.pieces[rank]:
        start = layout.doc_start(p.doc)
        key_end = p.end if causal else layout.cu_seqlens[p.doc + 1] - start
        out.append((local, len(p), p.start, row_of[start : start + key_end]))
        local += len(p)
    return out


def _torch_pieces(q_THD, k_RHD, v_RHD, pieces, scale, causal) -> torch.Tensor:
    outs = []
    for local, n, offset, key_rows in pieces:
        for b in range(0, n, QUERY_BLOCK):
            qb = min(QUERY_BLOCK, n - b)
            n_keys = offset + b + qb if causal else key_rows.numel()
            rows = key_rows[:n_keys]
            q_1HQD = q_THD[local + b : local + b + qb].transpose(0, 1).unsqueeze(0)
            k_1HKD = k_RHD.index_select(0, rows).transpose(0, 1).unsqueeze(0)
            v_1HKD = v_RHD.index_select(0, rows).transpose(0, 1).unsqueeze(0)
            mask = None
            if causal:
                query_pos = torch.arange(offset + b, offset + b + qb, device=q_THD.device)
                mask = torch.arange(n_keys, device=q_THD.device)[None, :] <= query_pos[:, None]
            o = F.scaled_dot_product_attention(
                q_1HQD,
                k_1HKD,
                v_1HKD,
                attn_mask=mask,
                scale=scale,
                enable_gqa=q_1HQD.shape[1] != k_1HKD.shape[1],
            )
            outs.append(o[0].transpose(0, 1))
    if not outs:
        return q_THD.new_zeros(0, q_THD.shape[1], v_RHD.shape[2])
    return torch.cat(outs, 0)


_KERNELS = {"flash": flash_pieces, "torch_varlen": torch_varlen_pieces, "torch": _torch_pieces}


def resolve_attention_backend(
    backend: str, device_type: str, dtype: torch.dtype | None = None
) -> str:
    """The kernel :func:`varlen_attention` runs for ``backend`` on ``device_type`` tensors of
    ``dtype`` (``None``: any): ``flash`` (flash-attn), ``torch_varlen`` (torch's
    ``varlen_attn``) or ``torch`` (SDPA per document piece). ``auto`` takes the first of
    ``flash``, ``torch_varlen`` that can run, else ``torch``. ``ValueError`` for a named backend
    that cannot run there (the reason :func:`varlen_attention` would give)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        fast = [k for k in ("flash", "torch_varlen") if _cannot_run(k, device_type, dtype) is None]
        return fast[0] if fast else "torch"
    reason = _cannot_run(backend, device_type, dtype)
    if reason is not None:
        raise ValueError(reason)
    return backend


def _cannot_run(kernel: str, device_type: str, dtype: torch.dtype | None) -> str | None:
    if kernel == "torch":
        return None
    if kernel == "flash" and not (device_type == "cuda" and _flash_available()):
        return (
            "backend='flash' needs the flash-attn package and CUDA tensors (install "
            "cp-varlen-attn[flash-attn]; backend='torch_varlen' needs nothing beyond torch)"
        )
    if kernel == "torch_varlen" and not (device_type == "cuda" and torch_varlen_available()):
        return (
            "backend='torch_varlen' needs CUDA tensors and torch.nn.attention.varlen "
            f"(torch >= 2.10); got {device_type} tensors and torch {torch.__version__}"
        )
    if dtype is not None and dtype not in HALF_DTYPES:
        return (
            f"backend={kernel!r} takes bfloat16 or float16 tensors, got {dtype} "
            "(backend='torch' runs any dtype)"
        )
    return None


@functools.cache
def _flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _validate(q, k, v, layout, group, rank, backend) -> None:
    check_call(layout, group, _local_error(q, k, v, layout, group, rank, backend))


def _local_error(q, k, v, layout, group, rank, backend) -> str | None:
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; expected one of {BACKENDS}"
    if backend != "auto":
        reason = _cannot_run(backend, q.device.type, q.dtype)
        if reason is not None:
            return reason
    if not (q.dim() == k.dim() == v.dim() and q.dim() in (3, 4)):
        return f"q, k, v must all be [1, T, H, D] (or [T, H, D]); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if q.dim() == 4 and q.shape[0] != 1:
        return f"the layout describes one packed sequence: batch size must be 1, got {q.shape[0]}"
    t_dim = q.dim() - 3
    if not (q.shape[t_dim] == k.shape[t_dim] == v.shape[t_dim]):
        return f"q, k, v token counts differ: {q.shape[t_dim]}, {k.shape[t_dim]}, {v.shape[t_dim]}"
    if k.shape[-2] != v.shape[-2] or q.shape[-1] != k.shape[-1]:
        return f"k/v heads or q/k head dims differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.shape[-2] % k.shape[-2] != 0:
        return f"GQA needs query heads to be a multiple of key/value heads; got {q.shape[-2]} and {k.shape[-2]}"
    world = dist.get_world_size(group) if group is not None else 1
    if world != layout.cp_size:
        return f"the layout is for {layout.cp_size} CP ranks but the group has {world}"
    if q.shape[t_dim] != layout.local_len(rank):
        return f"rank {rank} holds {layout.local_len(rank)} tokens in the layout but got {q.shape[t_dim]}"
    return None
