"""find_fusion_patterns on hand-built graphs (single process; the real graphs are in the gloo test)."""

import pytest
import torch
from torch import fx

from async_tp_linear import find_fusion_patterns


def _graph_with_collectives(gather_consumer: str) -> fx.Graph:
    """all_gather -> wait -> [mm | addmm] and mm -> reduce_scatter -> wait, with fake metadata."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    c10d = torch.ops._c10d_functional
    aten = torch.ops.aten
    with FakeTensorMode() as mode:
        shard, full = torch.empty(4, 16), torch.empty(8, 16)
        w, y = torch.empty(16, 32), torch.empty(8, 32)
        bias, rs_out = torch.empty(32), torch.empty(4, 32)
    g = fx.Graph()

    def node(target, args, val):
        n = g.call_function(target, args)
        n.meta["val"] = val
        return n

    a = g.placeholder("primals_1")
    a.meta["val"] = shard
    wt = g.placeholder("primals_2")
    wt.meta["val"] = w
    b = g.placeholder("primals_3")
    b.meta["val"] = bias
    ag = node(c10d.all_gather_into_tensor.default, (a, 2, "tp_group"), full)
    gathered = node(c10d.wait_tensor.default, (ag,), full)
    if gather_consumer == "mm":
        y_n = node(aten.mm.default, (gathered, wt), y)
    else:
        y_n = node(aten.addmm.default, (b, gathered, wt), y)
    rs = node(c10d.reduce_scatter_tensor.default, (y_n, "sum", 2, "tp_group"), rs_out)
    out = node(c10d.wait_tensor.default, (rs,), rs_out)
    g.output((out,))
    del mode
    return g


def test_mm_sites_are_matchable_and_addmm_sites_are_not():
    import torch._inductor.config as inductor_config

    graph = _graph_with_collectives("mm")
    (mm,) = [n.name for n in graph.nodes if n.target is torch.ops.aten.mm.default]
    with inductor_config.patch(_micro_pipeline_tp=True):
        sites = find_fusion_patterns(graph)
    assert [(s.kind, s.matchable) for s in sites] == [
        ("all_gather_matmul", True),
        ("matmul_reduce_scatter", True),
    ]
    assert all(s.group_name == "tp_group" and s.dim == 0 for s in sites)
    assert all(s.matmuls == (mm,) for s in sites), sites
    # Flag on, but no CPU process has symmetric memory: the reason names the shut gate.
    assert all(s.status == "matchable" for s in sites), sites
    assert all("symmetric memory" in s.reason or "NCCL" in s.reason for s in sites), sites

    sites = find_fusion_patterns(_graph_with_collectives("addmm"))
    assert [(s.kind, s.status) for s in sites] == [
        ("all_gather_matmul", "unmatched"),
        ("matmul_reduce_scatter", "unmatched"),
    ]
    assert all("aten.addmm" in s.reason and s.matmuls == () for s in sites), sites


def test_flag_off_is_named_as_the_reason():
    import torch._inductor.config as inductor_config

    with inductor_config.patch(_micro_pipeline_tp=False):
        sites = find_fusion_patterns(_graph_with_collectives("mm"))
    assert {s.reason for s in sites} == {"torch._inductor.config._micro_pipeline_tp is off"}


def test_graph_module_accepted_and_empty_graph_has_no_sites():
    gm = fx.symbolic_trace(lambda x: x + 1)
    assert find_fusion_patterns(gm) == []


def test_bad_inputs():
    with pytest.raises(TypeError, match=r"expected a torch.fx.GraphModule or Graph, got Linear"):
        find_fusion_patterns(torch.nn.Linear(2, 2))
    g = _graph_with_collectives("mm")
    for n in g.nodes:
        n.meta.pop("val", None)
    with pytest.raises(ValueError, match=r"lacks meta\['val'\]; pass the post-grad graph"):
        find_fusion_patterns(g)
