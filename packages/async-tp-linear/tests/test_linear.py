"""tp_linear / TPLinear equal a naive float64 linear in forward and backward, eager and compiled."""

import pytest
import torch
import torch.nn.functional as F
from compile_helpers import no_graph_cache
from torch import nn

from async_tp_linear import TPLinear, tp_linear
from dist_testkit import assert_close


def naive_linear(x, weight, bias):
    """out[..., o] = sum_h x[..., h] * weight[o, h] + bias[o], by explicit loops over o."""
    cols = [(x * weight[o]).sum(-1) for o in range(weight.shape[0])]
    out = torch.stack(cols, dim=-1)
    return out if bias is None else out + bias


def _inputs(shape, with_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, 6, generator=g)
    w = torch.randn(5, 6, generator=g)
    b = torch.randn(5, generator=g) if with_bias else None
    grad_out = torch.randn(*shape, 5, generator=g)
    return x, w, b, grad_out


def _run(fn, x, w, b, grad_out, dtype):
    leaves = [
        t.detach().to(dtype).requires_grad_() for t in (x, w) + ((b,) if b is not None else ())
    ]
    out = fn(leaves[0], leaves[1], leaves[2] if b is not None else None)
    (out * grad_out.to(dtype)).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _check_against_naive(fn, shape, with_bias):
    x, w, b, grad_out = _inputs(shape, with_bias)
    out, grads = _run(fn, x, w, b, grad_out, torch.float32)
    ref_out, ref_grads = _run(naive_linear, x, w, b, grad_out, torch.float64)
    assert_close(out, ref_out.float(), rtol=1e-5, atol=1e-5, name="out")
    for name, g, rg in zip(["x", "weight", "bias"], grads, ref_grads, strict=False):
        assert_close(g, rg.float(), rtol=1e-5, atol=1e-5, name=f"{name}.grad")


@pytest.mark.parametrize("shape", [(7,), (2, 3), (2, 3, 4)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_eager_matches_naive(shape, with_bias):
    _check_against_naive(tp_linear, shape, with_bias)


def test_eager_is_f_linear_bit_for_bit():
    x, w, b, _ = _inputs((2, 3), True)
    assert torch.equal(tp_linear(x, w, b), F.linear(x, w, b))


def test_compiled_with_async_tp_flag_emits_plain_mm_and_matches_naive():
    """One compile covers 3-D+bias, 2-D+bias and 3-D without bias; the post-grad graph must hold
    only aten.mm (no addmm: a bias fused into the matmul would hide it from the TP pass)."""
    import torch._inductor.config as inductor_config

    graphs = []
    cases = [((2, 3), True), ((4,), True), ((2, 3), False)]
    data = [_inputs(shape, bias, seed=i) for i, (shape, bias) in enumerate(cases)]

    def three_linears(*leaves):
        outs, i = [], 0
        for _, _, b, _ in data:
            n = 3 if b is not None else 2
            args = leaves[i : i + n]
            outs.append(tp_linear(args[0], args[1], args[2] if n == 3 else None))
            i += n
        return outs

    leaves = []
    for x, w, b, _ in data:
        leaves += [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    with (
        no_graph_cache(),
        inductor_config.patch(
            _micro_pipeline_tp=True,
            post_grad_custom_post_pass=lambda g: graphs.append(
                [n.target for n in g.nodes if n.op == "call_function"]
            ),
        ),
    ):
        torch._dynamo.reset()
        outs = torch.compile(three_linears, fullgraph=True)(*leaves)
        sum((o * d[3]).sum() for o, d in zip(outs, data, strict=True)).backward()
    torch._dynamo.reset()

    ref_outs = []
    i = 0
    for _, _, b, _ in data:
        n = 3 if b is not None else 2
        args = ref_leaves[i : i + n]
        ref_outs.append(naive_linear(args[0], args[1], args[2] if n == 3 else None))
        i += n
    sum((o * d[3].double()).sum() for o, d in zip(ref_outs, data, strict=True)).backward()
    for k, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
        assert_close(o, r.float(), rtol=1e-5, atol=1e-5, name=f"out{k}")
    for k, (t, r) in enumerate(zip(leaves, ref_leaves, strict=True)):
        assert_close(t.grad, r.grad.float(), rtol=1e-5, atol=1e-5, name=f"leaf{k}.grad")

    forward = graphs[0]
    assert forward.count(torch.ops.aten.mm.default) == 3, " ".join(str(t) for t in forward)
    assert torch.ops.aten.addmm.default not in forward, forward


def test_tplinear_shares_parameters_and_matches_linear():
    torch.manual_seed(0)
    linear = nn.Linear(6, 5)
    tpl = TPLinear.from_linear(linear)
    assert tpl.weight is linear.weight and tpl.bias is linear.bias
    assert list(tpl.state_dict()) == list(linear.state_dict())
    x = torch.randn(2, 3, 6)
    assert torch.equal(tpl(x), linear(x))
    no_bias = TPLinear.from_linear(nn.Linear(6, 5, bias=False))
    assert no_bias.bias is None
    _check_against_naive(_tplinear_forward, (2, 3), True)


def _tplinear_forward(x, weight, bias):
    """TPLinear.forward with the given tensors (kept as autograd leaves) as its parameters."""
    lin = TPLinear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    del lin.weight
    lin.weight = weight
    if bias is not None:
        del lin.bias
        lin.bias = bias
    return lin(x)


def test_bad_inputs():
    x, w, b, _ = _inputs((2, 3), True)
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        tp_linear([1.0], w)
    with pytest.raises(TypeError, match=r"bias must be a torch.Tensor, got float"):
        tp_linear(x, w, 1.0)
    with pytest.raises(ValueError, match=r"weight must be 2-D \[out, in\], got shape \(6,\)"):
        tp_linear(x, w[0])
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., in=6\].*got shape \(2, 3, 4\)"):
        tp_linear(x[..., :4], w)
    with pytest.raises(ValueError, match=r"bias must be 1-D \[out=5\], got shape \(4,\)"):
        tp_linear(x, w, b[:4])
    with pytest.raises(TypeError, match=r"expects an nn.Linear, got Conv1d"):
        TPLinear.from_linear(nn.Conv1d(2, 2, 1))
