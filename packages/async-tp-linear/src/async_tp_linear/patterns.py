"""Did async TP fire? The all-gather→mm and mm→reduce-scatter sites of a post-grad FX graph.

The answer is computed with the micro-pipeline TP pass's OWN matchers, imported from
``torch._inductor.fx_passes.micro_pipeline_tp`` (``find_all_gather_patterns``,
``find_reduce_scatter_patterns``, ``_get_fusible_all_gather_matmuls``,
``_get_fusible_reduce_scatter_matmul``, ``_get_unexposed_collectives``), so it tracks the
installed torch instead of a copy of its rules. There is deliberately no hand-written fallback
matcher: a torch that lacks these helpers gets a ``RuntimeError`` naming them, rather than an
answer that might disagree with the pass.

For each collective site the status is one of:

- ``"fused"``: the graph already holds the fused ``symm_mem`` op (the pass ran and rewrote it);
- ``"would_fuse"``: the pass's matcher accepts it and all of the pass's runtime gates pass now
  (flag set, NCCL/XCCL present, symmetric memory enabled for the group, not left to plain
  compute/communication overlap by ``reorder_for_compute_comm_overlap``);
- ``"matchable"``: the matcher accepts it but a runtime gate fails (``reason`` names it) — the
  layer is shaped right, the environment is not;
- ``"unmatched"``: the collective has no matmul the pass accepts (``reason`` names the ops that
  are there instead, e.g. ``aten.addmm`` when a bias is fused into the matmul).

Give it the graph Inductor's post-grad passes see (e.g. from
``torch._inductor.config.post_grad_custom_post_pass``): nodes need ``meta["val"]``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.distributed as dist
from torch import fx

__all__ = ["FusionSite", "find_fusion_patterns"]

Status = Literal["fused", "would_fuse", "matchable", "unmatched"]
_HELPERS = (
    "find_all_gather_patterns",
    "find_reduce_scatter_patterns",
    "_get_fusible_all_gather_matmuls",
    "_get_fusible_reduce_scatter_matmul",
    "_get_unexposed_collectives",
)


@dataclasses.dataclass(frozen=True)
class FusionSite:
    """One all-gather→matmul or matmul→reduce-scatter site of a graph."""

    kind: Literal["all_gather_matmul", "matmul_reduce_scatter"]
    status: Status
    collective: str  # name of the collective node (or of the fused op when status == "fused")
    matmuls: tuple[str, ...]  # mm nodes the pass would fold in (empty when unmatched or fused)
    group_name: str
    dim: int  # gather dim / scatter dim
    reason: str  # why it is not "would_fuse"/"fused"; "" otherwise

    @property
    def matchable(self) -> bool:
        """The graph has the shape the pass rewrites here (whatever the environment)."""
        return self.status != "unmatched"


def _mptp():
    from torch._inductor.fx_passes import micro_pipeline_tp

    missing = [h for h in _HELPERS if not hasattr(micro_pipeline_tp, h)]
    if missing:
        raise RuntimeError(
            f"find_fusion_patterns: torch {torch.__version__} lacks the micro-pipeline TP "
            f"matchers {missing} (present in torch 2.15); refusing to guess the pass's rules"
        )
    return micro_pipeline_tp


def _fused_targets() -> dict[object, str]:
    if dist.is_available():
        # Defines the symm_mem op namespace (the pass imports it too before emitting the ops).
        import torch.distributed._symmetric_memory
    ops = getattr(torch.ops, "symm_mem", None)
    table = {
        "fused_all_gather_matmul": "all_gather_matmul",
        "fused_all_gather_scaled_matmul": "all_gather_matmul",
        "fused_matmul_reduce_scatter": "matmul_reduce_scatter",
        "fused_scaled_matmul_reduce_scatter": "matmul_reduce_scatter",
    }
    out: dict[object, str] = {}
    for op_name, kind in table.items():
        packet = getattr(ops, op_name, None) if ops is not None else None
        if packet is not None:
            out[packet.default] = kind
    return out


def _fused_site(node: fx.Node, kind: str) -> FusionSite:
    schema = node.target._schema  # type: ignore[union-attr]
    args = {a.name: v for a, v in zip(schema.arguments, node.args, strict=False)} | node.kwargs
    dim = args.get("gather_dim", args.get("orig_scatter_dim", args.get("scatter_dim", -1)))
    return FusionSite(kind, "fused", node.name, (), str(args.get("group_name", "")), int(dim), "")  # type: ignore[arg-type]


def _runtime_gate(group_name: str) -> str:
    """The first of the pass's runtime conditions that fails now ("" when all pass)."""
    from torch._inductor import config

    if not getattr(config, "_micro_pipeline_tp", False):
        return "torch._inductor.config._micro_pipeline_tp is off"
    if not (dist.is_available() and (dist.is_nccl_available() or dist.is_xccl_available())):
        return "torch.distributed has neither NCCL nor XCCL"
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group

    if not is_symm_mem_enabled_for_group(group_name):
        return f"symmetric memory is not enabled for group {group_name!r}"
    return ""


def _op_names(nodes: list[fx.Node]) -> str:
    names = sorted(
        {str(n.target).removesuffix(".default") for n in nodes if n.op == "call_function"}
    )
    return ", ".join(names) if names else "none"


def _ag_consumers(res_node: fx.Node) -> list[fx.Node]:
    """The ops that read the gathered tensor, looking through one reshape."""
    out = []
    for user in res_node.users:
        if user.target is torch.ops.aten.reshape.default:
            out.extend(user.users)
        else:
            out.append(user)
    return out


def _rs_producer(input_node: fx.Node) -> list[fx.Node]:
    if input_node.target is torch.ops.aten.reshape.default and isinstance(
        input_node.args[0], fx.Node
    ):
        return [input_node.args[0]]
    return [input_node]


def _sites(graph: fx.Graph) -> list[tuple[fx.Node, FusionSite]]:
    mptp = _mptp()
    from torch._inductor import config

    hidden = set()
    if config.reorder_for_compute_comm_overlap:
        hidden = set(mptp._get_unexposed_collectives(graph))

    def classify(
        collective: fx.Node, mm_nodes: list[fx.Node], group: str, seen: str
    ) -> tuple[Status, str]:
        if not mm_nodes:
            return "unmatched", f"no aten.mm the pass accepts; found {seen}"
        if collective in hidden:
            return "matchable", "left to plain overlap (reorder_for_compute_comm_overlap)"
        gate = _runtime_gate(group)
        return ("matchable", gate) if gate else ("would_fuse", "")

    sites: list[tuple[fx.Node, FusionSite]] = []
    for ag in mptp.find_all_gather_patterns(graph):
        mm_nodes = [_mm_node(m) for m in mptp._get_fusible_all_gather_matmuls(ag)]
        group = str(ag.group_name)
        seen = _op_names(_ag_consumers(ag.res_node))
        status, reason = classify(ag.ag_node, mm_nodes, group, seen)
        names = tuple(n.name for n in mm_nodes)
        site = FusionSite(
            "all_gather_matmul", status, ag.ag_node.name, names, group, int(ag.gather_dim), reason
        )
        sites.append((ag.ag_node, site))

    for rs in mptp.find_reduce_scatter_patterns(graph):
        matmul = mptp._get_fusible_reduce_scatter_matmul(rs)
        mm_nodes = [] if matmul is None else [_mm_node(matmul)]
        group = str(rs.group_name)
        seen = _op_names(_rs_producer(rs.input_node))
        status, reason = classify(rs.reduce_scatter_node, mm_nodes, group, seen)
        names = tuple(n.name for n in mm_nodes)
        site = FusionSite(
            "matmul_reduce_scatter",
            status,
            rs.reduce_scatter_node.name,
            names,
            group,
            int(rs.scatter_dim),
            reason,
        )
        sites.append((rs.reduce_scatter_node, site))
    return sites


def _mm_node(matmul: object) -> fx.Node:
    """The mm node of the pass's ``_Matmul`` (``[mm]`` or ``[reshape, mm, reshape]``)."""
    nodes = matmul.nodes  # type: ignore[attr-defined]
    return nodes[1] if len(nodes) == 3 else nodes[0]


def find_fusion_patterns(graph_module: fx.GraphModule | fx.Graph) -> list[FusionSite]:
    """Every all-gather→matmul and matmul→reduce-scatter site of a post-grad graph, in graph order.

    Args:
        graph_module: a post-grad ``GraphModule`` (or its ``Graph``) whose nodes carry
            ``meta["val"]``.

    Returns:
        One :class:`FusionSite` per all-gather / reduce-scatter the pass's matchers recognise,
        plus one per fused ``symm_mem`` op already in the graph.
    """
    if isinstance(graph_module, fx.GraphModule):
        graph = graph_module.graph
    elif isinstance(graph_module, fx.Graph):
        graph = graph_module
    else:
        raise TypeError(
            "find_fusion_patterns: expected a torch.fx.GraphModule or Graph, "
            f"got {type(graph_module).__name__}"
        )
    fused_targets = _fused_targets()
    sites = [
        (node, _fused_site(node, fused_targets[node.target]))
        for node in graph.nodes
        if node.op == "call_function" and node.target in fused_targets
    ]
    try:
        sites += _sites(graph)
    except KeyError as err:
        raise ValueError(
            f"find_fusion_patterns: a node lacks meta[{err}]; pass the post-grad graph Inductor "
            "compiles (e.g. via post_grad_custom_post_pass), not a plain symbolic trace"
        ) from err
    order = {node: i for i, node in enumerate(graph.nodes)}
    return [site for _, site in sorted(sites, key=lambda pair: order[pair[0]])]
