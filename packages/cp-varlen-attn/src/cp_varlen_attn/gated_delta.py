"""``gated_delta_rule``: the gated delta rule on packed documents, on one rank or under CP.

Conventions follow fla and transformers' ``torch_chunk_gated_delta_rule``: q/k [1, T, H_k, K],
v [1, T, H_v, V], g (log-decay, ≤ 0) and beta [1, T, H_v]; each query/key head serves
``H_v / H_k`` consecutive value heads; q and k are L2-normalised (``x·rsqrt(Σx² + 1e-6)``, in
fp32) when ``use_qk_l2norm``; q is scaled by ``scale`` (default ``K**-0.5``). The state of a
value head is S ∈ R^{K×V}; the output has q's dtype, the final state the compute dtype (fp32,
or fp64 for fp64 inputs).

Correctness: documents never share state — each ``cu_seqlens`` segment is run as its own
segment from its own initial state (zero by default), see :mod:`cp_varlen_attn.gdn_chunk` for
the exact chunked form. Under CP each rank runs its own pieces and the incoming state of a piece
that does not start its document is obtained from the affine summaries of the pieces before it
(:mod:`cp_varlen_attn.gdn_cp`). Same math, re-associated: equal to the single-rank result up to
floating-point rounding, forward and backward.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from cp_varlen_attn.gdn_chunk import run_segments
from cp_varlen_attn.gdn_cp import cp_gated_delta
from cp_varlen_attn.layout import CPLayout
from cp_varlen_attn.validation import check_call

__all__ = ["GDN_BACKENDS", "gated_delta_rule"]

GDN_BACKENDS = ("auto", "torch", "fla")
L2NORM_EPS = 1e-6


@torch.compiler.disable  # layout-driven Python: compiled callers run it eagerly
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    layout: CPLayout | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over packed documents.

    Args:
        q, k: [1, T, H_k, K] queries and keys (this rank's tokens under CP, in layout order).
        v: [1, T, H_v, V] values, ``H_v`` a multiple of ``H_k``.
        g: [1, T, H_v] log-decay per token and value head (the state is multiplied by ``exp(g)``).
        beta: [1, T, H_v] write strength per token and value head.
        cu_seqlens: int [N + 1] document boundaries (``None``: one document). Under CP the
            layout's ``cu_seqlens`` are used; if given, they must equal them.
        initial_state: [N, H_v, K, V] per-document starting state (``None``: zeros). Under CP
            pass the same tensor on every rank; row ``d`` is read by the rank holding document
            ``d``'s first token, so its gradient lands there (zero on the other ranks).
        output_final_state: also return the state after each document.
        layout, group: CP layout and its process group (``layout.cp_size`` ranks).
        backend: ``"torch"`` (exact chunked pure torch), ``"fla"`` (fla kernels, CUDA) or
            ``"auto"`` (fla when installed and the tensors are on CUDA).
    Returns:
        ``(out, final_state)``: out [1, T, H_v, V] in q's dtype; final_state [N, H_v, K, V] (or
        ``None``). Under CP row ``d`` of final_state is filled on the rank holding document
        ``d``'s last token and zero elsewhere (an all-reduce sum gives every rank all rows).
    """
    rank = dist.get_rank(group) if group is not None else 0
    error = _local_error(q, k, v, g, beta, cu_seqlens, initial_state, layout, group, rank, backend)
    if isinstance(layout, CPLayout):
        check_call(layout, group, error)
    elif error is not None:
        raise ValueError(error)

    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads_v, dk = v.shape[2], q.shape[3]
    q_THK, k_THK = _prepare_qk(q[0], k[0], heads_v, use_qk_l2norm, scale, cdt)
    v_THV, g_TH, beta_TH = v[0].to(cdt), g[0].to(cdt), beta[0].to(cdt)
    runner = _fla_segments if _use_fla(backend, q) else run_segments
    state0 = None if initial_state is None else initial_state.to(cdt)
    if layout is None:
        cu = [0, q.shape[1]] if cu_seqlens is None else [int(x) for x in cu_seqlens]
        bounds = tuple(itertools.pairwise(cu))
        if state0 is None:
            state0 = v_THV.new_zeros(len(bounds), heads_v, dk, v.shape[3])
        out_THV, final = runner(q_THK, k_THK, v_THV, g_TH, beta_TH, bounds, state0)
    else:
        out_THV, final = cp_gated_delta(
            q_THK, k_THK, v_THV, g_TH, beta_TH, layout, group, rank, state0, runner
        )
    return out_THV.to(q.dtype).unsqueeze(0), (final if output_final_state else None)


def _prepare_qk(q_THK, k_THK, heads_v, use_l2norm, scale, cdt):
    q_THK, k_THK = q_THK.to(cdt), k_THK.to(cdt)
    if use_l2norm:
        q_THK = q_THK * torch.rsqrt((q_THK * q_THK).sum(-1, keepdim=True) + L2NORM_EPS)
        k_THK = k_THK * torch.rsqrt((k_THK * k_THK).sum(-1, keepdim=True) + L2NORM_EPS)
    q_THK = q_THK * (scale if scale is not None else q_THK.shape[-1] ** -0.5)
    groups = heads_v // k_THK.shape[1]
    if groups > 1:
        q_THK, k_THK = q_THK.repeat_interleave(groups, 1), k_THK.repeat_interleave(groups, 1)
    return q_THK, k_THK


def resolve_gdn_backend(backend: str, device_type: str) -> str:
    """The kernel :func:`gated_delta_rule` runs for ``backend`` on ``device_type`` tensors:
    ``fla`` (fla installed, CUDA) or ``torch`` (the exact chunked rule); ``ValueError`` for a
    backend that cannot run there."""
    if backend not in GDN_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {GDN_BACKENDS}")
    fla = device_type == "cuda" and _fla_available()
    if backend == "fla" and not fla:
        raise ValueError(
            "backend='fla' needs the flash-linear-attention package and CUDA tensors "
            "(install cp-varlen-attn[gpu])"
        )
    return "fla" if backend == "fla" or (backend == "auto" and fla) else "torch"


def _fla_available() -> bool:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def _use_fla(backend: str, q: torch.Tensor) -> bool:
    return backend == "fla" or (backend == "auto" and q.is_cuda and _fla_available())


def _fla_segments(q_THK, k_THK, v_THW, g_TH, beta_TH, bounds, state0_NHKW):
    """Same contract as :func:`run_segments`, through fla's chunked kernel (q, k prepared here)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if not bounds:
        return v_THW.new_zeros(0, *v_THW.shape[1:]), state0_NHKW
    lengths = [e - s for s, e in bounds]
    rows = torch.cat([torch.arange(s, e) for s, e in bounds]).to(q_THK.device)
    cu = torch.tensor([0, *lengths], device=q_THK.device).cumsum(0)
    pick = [
        x.index_select(0, rows).unsqueeze(0).contiguous()
        for x in (q_THK, k_THK, v_THW, g_TH, beta_TH)
    ]
    out, final = chunk_gated_delta_rule(
        *pick,
        scale=1.0,
        initial_state=state0_NHKW.float().contiguous(),
        output_final_state=True,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=False,
    )
    return out[0].to(v_THW.dtype), final.to(v_THW.dtype)


def _local_error(
    q, k, v, g, beta, cu_seqlens, initial_state, layout, group, rank, backend
) -> str | None:
    if backend not in GDN_BACKENDS:
        return f"unknown backend {backend!r}; expected one of {GDN_BACKENDS}"
    if backend == "fla" and not (_fla_available() and q.is_cuda):
        return "backend='fla' needs the flash-linear-attention package (fla) and CUDA tensors (install cp-varlen-attn[gpu])"
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return f"{name} must be a floating-point tensor, got {type(x).__name__} {getattr(x, 'dtype', '')}"
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or q.shape[0] != 1:
        return f"q, k must be [1, T, H_k, K] and v [1, T, H_v, V]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if (
        v.shape[1] != q.shape[1]
        or tuple(g.shape) != tuple(v.shape[:3])
        or tuple(beta.shape) != tuple(v.shape[:3])
    ):
        return f"v [1, T, H_v, V], g and beta [1, T, H_v] must match q [1, T, ...]; got q {tuple(q.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}"
    if v.shape[2] % q.shape[2] != 0:
        return f"value heads ({v.shape[2]}) must be a multiple of query/key heads ({q.shape[2]})"
    if layout is None:
        if cu_seqlens is None:
            n_docs = 1
        else:
            cu = [int(x) for x in cu_seqlens]
            if (
                len(cu) < 2
                or cu[0] != 0
                or cu[-1] != q.shape[1]
                or any(b <= a for a, b in itertools.pairwise(cu))
            ):
                return f"cu_seqlens must start at 0, increase strictly and end at T={q.shape[1]}; got {cu[:16]}"
            n_docs = len(cu) - 1
    else:
        if not isinstance(layout, CPLayout):
            return f"layout must be a CPLayout, got {type(layout).__name__}"
        if cu_seqlens is not None and tuple(int(x) for x in cu_seqlens) != layout.cu_seqlens:
            return "cu_seqlens differ from layout.cu_seqlens (under CP the layout's are used; pass None or the same)"
        world = dist.get_world_size(group) if group is not None else 1
        if world != layout.cp_size:
            return f"the layout is for {layout.cp_size} CP ranks but the group has {world}"
        if q.shape[1] != layout.local_len(rank):
            return f"rank {rank} holds {layout.local_len(rank)} tokens in the layout but got {q.shape[1]}"
        n_docs = layout.num_docs
    want = (n_docs, v.shape[2], q.shape[3], v.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != want:
        return (
            f"initial_state must be [N, H_v, K, V] = {list(want)}, got {list(initial_state.shape)}"
        )
    return None
