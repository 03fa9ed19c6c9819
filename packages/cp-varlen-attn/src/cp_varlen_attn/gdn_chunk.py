"""The gated delta rule over independent segments, chunked (WY form), exact in fp32 or fp64.

Per head, with q already L2-normalised and scaled, one token does (see ALGORITHMS.md)
``S ← exp(g)·S;  S ← S + β·k·(v − Sᵀk)ᵀ;  o = Sᵀq``. Inside a chunk of ``C`` tokens with
cumulative log-decay ``G_t = g_1 + … + g_t`` the chunk's ``C`` delta-rule writes collapse (the
UT/WY transform) into one unit-lower-triangular solve::

    L = strict_lower((β·K Kᵀ) ∘ exp(G_i − G_j)),      U = (I + L)⁻¹ (β·V),   W = (I + L)⁻¹ (β·exp(G)·K)
    v_new = U − W·S,   O = (exp(G)·Q)·S + ((Q Kᵀ) ∘ exp(G_i − G_j))_{j≤i} · v_new
    S' = exp(G_C)·S + (exp(G_C − G)·K)ᵀ · v_new

which is the token recurrence re-associated — no approximation; every product is accumulated
in the compute dtype (fp32, or fp64 for fp64 inputs). Decays are masked to ``-inf`` above the
diagonal *before* the exponential, so no overflow reaches the result.

Segments (documents, or CP pieces) are independent: each starts from its own state and is cut
into its own chunks (the last one padded with ``g = 0, β = 0, k = v = q = 0``, which neither
decays nor writes the state). All chunks' intra-chunk work runs batched at once; the
inter-chunk scan steps through chunk index ``j`` with every segment that has a ``j``-th chunk
in the same batch (segments sorted longest first, so the active ones are a prefix).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["CHUNK", "run_segments"]

CHUNK = 64
# Intra-chunk work runs on blocks of whole scan steps of at most this many (chunk, head) pairs
# (or one step when a step alone is larger): big enough to batch, small enough to stay in cache.
BLOCK_CHUNK_HEADS = 64


@functools.lru_cache(maxsize=64)
def _schedule(bounds: tuple[tuple[int, int], ...], pad_row: int, chunk: int):
    """Chunk gather index (step-major), active counts per step, token→slot map and the sort."""
    n_chunks = [-(-(e - s) // chunk) for s, e in bounds]
    order = sorted(range(len(bounds)), key=lambda i: -n_chunks[i])
    rank_of = {seg: pos for pos, seg in enumerate(order)}
    steps = max(n_chunks, default=0)
    active = [sum(1 for n in n_chunks if n > j) for j in range(steps)]
    offsets = [0]
    for m in active:
        offsets.append(offsets[-1] + m)
    rows = torch.full((offsets[-1], chunk), pad_row, dtype=torch.long)
    ar = torch.arange(chunk)
    slots = []
    for seg, (s, e) in enumerate(bounds):
        for j in range(n_chunks[seg]):
            c = offsets[j] + rank_of[seg]
            r = s + j * chunk + ar
            rows[c] = torch.where(r < e, r, pad_row)
        j_tok = torch.arange(e - s)
        slots.append((torch.tensor(offsets)[j_tok // chunk] + rank_of[seg]) * chunk + j_tok % chunk)
    slot = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return rows, active, offsets, slot, torch.tensor(order, dtype=torch.long), inverse


def run_segments(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THW: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    bounds: tuple[tuple[int, int], ...],
    state0_NHKW: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every segment ``bounds[i] = (start, end)`` (rows of the inputs) from ``state0_NHKW[i]``.

    Inputs are in the compute dtype, q normalised and scaled, q/k already repeated to the value
    heads. Returns the outputs of the segments' tokens in segment order [sum of lengths, H, W]
    and each segment's final state [N, H, K, W].
    """
    n_tok, heads = k_THK.shape[:2]
    width = v_THW.shape[-1]
    if not bounds:
        return v_THW.new_zeros(0, heads, width), state0_NHKW
    rows, active, offsets, slot, order, inverse = _schedule(bounds, n_tok, chunk)
    dev = q_THK.device
    valid = (rows < n_tok).to(dev)
    rows = rows.clamp(max=n_tok - 1).to(dev)  # padding: any row, with g = beta = 0 (see docstring)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).triu(1)
    state = state0_NHKW.index_select(0, order.to(state0_NHKW.device))
    outs, finished = [], []
    j0 = 0
    while j0 < len(active):
        j1 = j0 + 1
        while j1 < len(active) and (offsets[j1 + 1] - offsets[j0]) * heads <= BLOCK_CHUNK_HEADS:
            j1 += 1
        blk = _intra_chunk(
            q_THK,
            k_THK,
            v_THW,
            g_TH,
            beta_TH,
            rows[offsets[j0] : offsets[j1]],
            valid[offsets[j0] : offsets[j1]],
            upper,
        )
        for j in range(j0, j1):
            sl = slice(offsets[j] - offsets[j0], offsets[j] - offsets[j0] + active[j])
            state = _scan_step(state, *(x[sl] for x in blk), outs)
            m_next = active[j + 1] if j + 1 < len(active) else 0
            finished.append(state[m_next:])
            state = state[:m_next]
        j0 = j1
    final = torch.cat(finished[::-1]).index_select(0, inverse.to(dev))
    out_flat = torch.cat(outs).movedim(1, 2).reshape(-1, heads, width)  # [n_chunks * C, H, W]
    return out_flat.index_select(0, slot.to(dev)), final


def _intra_chunk(q_THK, k_THK, v_THW, g_TH, beta_TH, rows, valid, upper):
    """Per chunk (rows [n, C] of the inputs): the WY quantities the scan needs."""

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, *] -> [n, H, C, *]
        # index_select: its backward adds the rows in a fixed order (conv.py says why)
        picked = x.index_select(0, rows.reshape(-1)).view(*rows.shape, *x.shape[1:])
        return picked.movedim(1, 2).contiguous()

    q, k, v = chunks(q_THK), chunks(k_THK), chunks(v_THW)
    g = chunks(g_TH) * valid[:, None, :]  # [n, H, C]
    beta = chunks(beta_TH) * valid[:, None, :]
    cum = g.cumsum(-1)
    decay_CC = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * decay_CC).tril(-1)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay_CC
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    return u, w, attn, q_dec, k_dec, chunk_decay


def _scan_step(state, u, w, attn, q_dec, k_dec, chunk_decay, outs):
    """One chunk of every active segment: append its outputs, return the state after it."""
    v_new = u - w @ state
    outs.append(q_dec @ state + attn @ v_new)
    return state * chunk_decay + k_dec.transpose(-1, -2) @ v_new
