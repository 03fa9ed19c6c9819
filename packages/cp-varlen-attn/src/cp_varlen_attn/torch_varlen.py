"""The varlen backends of :func:`cp_varlen_attn.varlen_attention`: a rank's pieces as ONE call of
a varlen attention kernel — torch's own ``torch.nn.attention.varlen.varlen_attn``
(``torch_varlen``: FlashAttention compiled into torch, or cuDNN where torch picks it, or FA3
where it is installed on a Hopper GPU; nothing to build) or flash-attn's
``flash_attn_varlen_func`` (``flash``).

Marshalling (:func:`varlen_args`): piece ``i`` of the rank is varlen "sequence" ``i``. Its
queries are the rank's local rows ``[local_i, local_i + n_i)`` (the pieces are contiguous in
local order, so the query tensor is passed as it is); its keys are the rows of its document's
positions ``[0, e_i)`` (causal; the whole document when not), gathered from the exchange
buffer. So ``cu_seq_q = [0, n_0, n_0 + n_1, ...]``, ``cu_seq_k`` the same over the key counts,
and ``max_q`` / ``max_k`` their largest entries.

Why one call equals per-document attention: with the causal window ``(-1, 0)`` and more keys
than queries, the Flash kernels (flash-attn, torch's FA2 and FA3) align the causal diagonal
bottom-right: query ``j`` of a sequence with ``q`` queries and ``k`` keys sees keys
``<= j + (k - q)``. Here ``k - q`` is the piece's offset ``s_i`` in its document, so query ``j``
sees document positions ``<= s_i + j``: exactly its causal prefix. cuDNN aligns packed causal
sequences top-left instead, and torch runs a causal ``varlen_attn`` on cuDNN only when
``cu_seq_q is cu_seq_k``; this module passes the same tensor only when every piece is a whole
document (``s_i = 0``), where the two alignments agree.

No log-sum-exp merge is needed: after :func:`cp_varlen_attn.exchange_rows` every piece holds ALL
its keys, so each query's softmax is formed whole inside one kernel call, forward and backward
(the gathered key rows' gradients flow back through the exchange to their owners, summed).
A split into partial results merged by their log-sum-exp would be wrong in the backward here:
``varlen_attn`` returns its ``AuxRequest(lse=True)`` output as non-differentiable.

Limits: the kernels take bf16 / fp16 only (an fp32 run takes the ``torch`` backend, and the
trainer's kernel report says so); FA3 replaces torch's FA2 process-wide once activated
(:func:`activate_fa3`), which only happens where its kernels are installed.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

__all__ = [
    "HALF_DTYPES",
    "activate_fa3",
    "flash_pieces",
    "torch_varlen_available",
    "torch_varlen_pieces",
    "varlen_args",
]

logger = logging.getLogger("cp_varlen_attn")

HALF_DTYPES = (torch.bfloat16, torch.float16)

# (first local row, length, offset in document, buffer rows of its keys) per local piece
Piece = tuple[int, int, int, torch.Tensor]


@functools.cache
def torch_varlen_available() -> bool:
    """This torch ships ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10)."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def varlen_args(pieces: list[Piece], device: torch.device):
    """``(key_rows [K], cu_seq_q [P + 1] int32, cu_seq_k [P + 1] int32, max_q, max_k)`` of the
    rank's ``pieces`` (see the module docstring); ``cu_seq_k is cu_seq_q`` when every piece has
    as many keys as queries (it starts its document: causal, or a whole document)."""
    key_rows = torch.cat([rows for *_, rows in pieces])
    q_lens = [n for _, n, _, _ in pieces]
    k_lens = [rows.numel() for *_, rows in pieces]
    cu_q = _cumulative(q_lens, device)
    cu_k = cu_q if k_lens == q_lens else _cumulative(k_lens, device)
    return key_rows, cu_q, cu_k, max(q_lens), max(k_lens)


def _packed(q_THD, k_RHD, v_RHD, pieces: list[Piece]):
    """The positional arguments both varlen kernels take: ``(q, k [K], v [K], cu_seq_q,
    cu_seq_k, max_q, max_k)``, the keys and values of every piece gathered in piece order
    (:func:`varlen_args`)."""
    key_rows, cu_q, cu_k, max_q, max_k = varlen_args(pieces, q_THD.device)
    keys, values = k_RHD.index_select(0, key_rows), v_RHD.index_select(0, key_rows)
    return q_THD, keys, values, cu_q, cu_k, max_q, max_k


def _cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


def _varlen_attn():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def torch_varlen_pieces(q_THD, k_RHD, v_RHD, pieces: list[Piece], scale: float, causal: bool):
    """[T_local, H_q, D_v]: the pieces' attention as one ``varlen_attn`` call."""
    if not pieces:
        return q_THD.new_zeros(0, q_THD.shape[1], v_RHD.shape[2])
    if q_THD.is_cuda:
        activate_fa3(q_THD.device)
    return _varlen_attn()(
        *_packed(q_THD, k_RHD, v_RHD, pieces),
        scale=scale,
        window_size=(-1, 0) if causal else (-1, -1),
        enable_gqa=q_THD.shape[1] != k_RHD.shape[1],
    )


def flash_pieces(q_THD, k_RHD, v_RHD, pieces: list[Piece], scale: float, causal: bool):
    """[T_local, H_q, D_v]: the pieces' attention as one ``flash_attn_varlen_func`` call (GQA is
    native there: fewer key/value heads are shared by groups of query heads)."""
    from flash_attn import flash_attn_varlen_func

    if not pieces:
        return q_THD.new_zeros(0, q_THD.shape[1], v_RHD.shape[2])
    return flash_attn_varlen_func(
        *_packed(q_THD, k_RHD, v_RHD, pieces),
        softmax_scale=scale,
        causal=causal,
    )


_fa3_state: dict[str, str] = {}


def activate_fa3(device: torch.device) -> str:
    """The flash implementation torch's varlen and SDPA flash calls run in this process:
    ``"FA3"`` once activated here, else ``"FA2"`` (torch's own). Activated on the first call
    where it can run: a Hopper GPU (compute capability 9.x), torch registers ``"FA3"``, the FA3
    kernels' module ``flash_attn_interface`` (flash-attention's ``hopper`` build) imports and no
    other implementation is active. Logged once: the switch is process-wide."""
    if "impl" in _fa3_state:
        return _fa3_state["impl"]
    from torch.nn.attention import (
        activate_flash_attention_impl,
        current_flash_attention_impl,
        list_flash_attention_impls,
    )

    impl = current_flash_attention_impl() or "FA2"
    if (
        impl == "FA2"
        and torch.cuda.get_device_capability(device)[0] == 9
        and "FA3" in list_flash_attention_impls()
        and importlib.util.find_spec("flash_attn_interface") is not None
    ):
        activate_flash_attention_impl("FA3")
        impl = "FA3"
        logger.info("torch_varlen: torch's FA3 flash implementation activated (process-wide)")
    _fa3_state["impl"] = impl
    return impl
