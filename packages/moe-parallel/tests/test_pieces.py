"""The routed experts on CPU in pieces (:mod:`moe_parallel.pieces`) equal one piece bit for bit:
the output and every gradient (rows, adapters), on the grouped GEMM (fp32, bf16), the loop
(fp64) and FP8 weights, with idle experts first, inside, last and a whole idle piece (zero
gradients for them); trained expert weights are not split into pieces."""

from __future__ import annotations

import pytest
import torch

from moe_parallel import BlockFormat, FP8Weight, LoRAFactors, expert_swiglu, quantize
from moe_parallel.grouped import grouped_mm_works
from moe_parallel.pieces import expert_pieces, takes_pieces

H, INTER, R = 16, 16, 8
COUNTS = [0, 3, 5, 0, 2, 0, 0, 4, 1, 0]  # idle first, inside, a run of idle, last


def test_pieces_close_at_rows_or_weights(monkeypatch):
    monkeypatch.setattr("moe_parallel.pieces.PIECE_ROWS", 5)
    monkeypatch.setattr("moe_parallel.pieces.PIECE_WEIGHTS", 300)
    assert expert_pieces(COUNTS, 100) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert expert_pieces(COUNTS, 1000) == [(e, e + 1) for e in range(10)]
    monkeypatch.setattr("moe_parallel.pieces.PIECE_ROWS", 100)
    assert expert_pieces(COUNTS, 1) == [(0, 10)]


def _inputs(dtype, fp8, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = len(COUNTS)

    def rand(*shape, scale=0.3):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    x = rand(sum(COUNTS), H, scale=1.0)
    weights = [rand(e, 2 * INTER, H).detach(), rand(e, H, INTER).detach()]  # frozen
    if fp8:
        forms = BlockFormat((5, 3), 2), BlockFormat((5, 3))
        weights = [
            FP8Weight(*quantize(w.detach(), f), f) for w, f in zip(weights, forms, strict=True)
        ]
    lora = LoRAFactors(rand(e, R, H), rand(e, 2 * INTER, R), rand(e, R, INTER), rand(e, H, R), 0.5)
    return x, weights, lora


@pytest.mark.parametrize(
    ("dtype", "fp8"),
    [
        (torch.float32, False),
        (torch.bfloat16, False),
        (torch.float64, False),
        (torch.bfloat16, True),
    ],
)
def test_pieces_equal_one_piece_bit_for_bit(dtype, fp8, monkeypatch):
    x, weights, lora = _inputs(dtype, fp8)
    assert grouped_mm_works(x, H, INTER, R) == (dtype != torch.float64)
    leaves = [x, *lora[:4]]
    g = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(1)).to(dtype)

    def run():
        y = expert_swiglu(x, torch.tensor(COUNTS), *weights, backend="torch", lora=lora)
        return y, torch.autograd.grad(y, leaves, g)

    monkeypatch.setattr("moe_parallel.pieces.PIECE_ROWS", 1 << 30)
    assert not takes_pieces(x.shape[0], x.device, *weights)  # all rows at once
    whole, whole_grads = run()
    monkeypatch.setattr("moe_parallel.pieces.PIECE_ROWS", 4)  # pieces of 1-2 experts
    assert takes_pieces(x.shape[0], x.device, *weights)
    y, grads = run()
    assert torch.equal(y, whole)
    for a, b in zip(grads, whole_grads, strict=True):
        assert torch.equal(a, b)
    idle = [e for e, n in enumerate(COUNTS) if n == 0]
    for factor in grads[1:5]:
        assert torch.count_nonzero(factor[idle]) == 0


def test_the_experts_module_in_pieces_equals_the_sorted_rows_bit_for_bit(monkeypatch):
    """``Experts`` on CPU gathers and scatters piece by piece (``assignments_in_pieces``): the
    [N, K, H] output, the input's and the adapters' gradients equal those of all rows sorted,
    computed whole and scattered back (the path expert parallelism keeps), bit for bit."""
    from moe_parallel import LoRASpec, add_expert_lora
    from moe_parallel.moe import Experts

    torch.manual_seed(0)
    experts = Experts(H, len(COUNTS), INTER, backend="torch")
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    add_expert_lora(experts, LoRASpec(R, 2.0 * R))
    torch.nn.init.normal_(experts.lora_gate_up_B, std=0.3)
    torch.nn.init.normal_(experts.lora_down_B, std=0.3)
    experts.gate_up_proj.requires_grad_(False)
    experts.down_proj.requires_grad_(False)
    top_i = torch.stack([torch.randperm(len(COUNTS))[:3] for _ in range(20)]) % 8  # idle 8, 9
    x = torch.randn(20, H, requires_grad=True)
    leaves = [x, *(p for p in experts.parameters() if p.requires_grad)]
    g = torch.randn(20, 3, H)

    def sorted_whole():
        flat = top_i.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(COUNTS))
        y = expert_swiglu(
            x.index_select(0, order // 3),
            counts,
            experts.gate_up_proj,
            experts.down_proj,
            backend="torch",
            lora=experts._lora_factors(),
        )
        return torch.zeros(60, H).index_copy(0, order, y).view(20, 3, H)

    want = sorted_whole()
    want_grads = torch.autograd.grad(want, leaves, g)
    monkeypatch.setattr("moe_parallel.pieces.PIECE_ROWS", 7)
    assert takes_pieces(60, x.device, experts.gate_up_proj, experts.down_proj)
    assert not takes_pieces(60, x.device, experts.gate_up_proj, experts.lora_down_A)  # trained
    y = experts(x, top_i)
    assert torch.equal(y, want)
    for a, b in zip(torch.autograd.grad(y, leaves, g), want_grads, strict=True):
        assert torch.equal(a, b)
