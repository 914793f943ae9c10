"""Megatron's tensor parallelism of a model's parameters: which dim of each weight a
tensor-parallel axis splits (``megatron_dims``), and the MoE routers it keeps whole.

The ``tp`` layouts (``autopar.passes.planner.layouts``) store every weight so, and a pinned
tensor-parallel axis (``autopar.passes.planner.pin_restrictions``) stores them so too.
"""

from __future__ import annotations

from torch import fx

from autopar.passes.planner.linears import Linear, linears
from autopar.passes.rules.registry import expert_weights_of
from autopar.passes.strategy_graph import StrategyGraph

EMBEDDING = "aten.embedding.default"
TOPK = "aten.topk.default"
TRANSPOSE = "aten.transpose.int"


def megatron_dims(graph: StrategyGraph, found: dict[fx.Node, Linear] | None = None) -> dict[fx.Node, int]:
    """Parameter placeholder -> the dim Megatron splits it along on the tp axis.

    Walks the graph in order, marking activations that are split by the tp axis: a
    linear (``autopar.passes.planner.linears``: a contraction with a parameter, however
    it is spelt) reading an unsplit activation is column-parallel (weight split on its
    output-features dim, bias with it, output split); one reading a split activation is
    row-parallel (weight split on its contracted dim, bias whole, output whole after its
    all-reduce). So ``linear``'s weight [out, in] splits on dim 0 then 1, and a weight
    stored [in, out] (GPT-2's ``Conv1D`` addmm, ``x @ w``) on dim 1 then 0. Embedding
    tables are split by vocabulary (dim 0). An MoE router (a linear whose scores reach a
    ``topk``) stays whole; an op with weights per expert (its rule's ``expert_weights``: a
    grouped matmul, the experts op) splits each as the rule says, column or row, or as a
    linear of the same kind (``expert_weights``: the expert parameter's dims); its output is
    split when its last weight is split by column. Other ops pass the mark on.
    ``found``: ``linears(graph)``, where the caller has it.
    """
    split: set[fx.Node] = set()
    dims: dict[fx.Node, int] = {}
    params = graph.captured.params
    found = linears(graph) if found is None else found
    routers = router_linears(graph, found)
    for node in graph.captured.nodes("call_function"):
        target = str(node.target)
        if node in routers:
            continue
        per_expert = expert_weights_of(node.target)
        if per_expert:
            column = False
            for weight in per_expert:  # column: output features (w's dim 2); row: input features (dim 1)
                column = weight.megatron == "column" or (weight.megatron is None and node.args[0] not in split)
                for w, dim in expert_weights(node, params, weight.arg).items():
                    dims.setdefault(w, dim[2] if column else dim[1])
            if column:
                split.add(node)
        elif node in found:
            linear = found[node]
            row = linear.x in split
            dim = linear.row if row else linear.column
            if dim is not None:
                dims.setdefault(linear.weight, dim)
            if linear.bias is not None and linear.bias_dim is not None and not row:
                dims.setdefault(linear.bias, linear.bias_dim)
            if not row:
                split.add(node)
        elif target == EMBEDDING:
            w = node.args[0]
            if isinstance(w, fx.Node) and w.name in params:
                dims.setdefault(w, 0)
        elif any(a in split for a in node.all_input_nodes):
            split.add(node)
    return dims


def expert_weights(node: fx.Node, params, arg: int = 1) -> dict[fx.Node, tuple[int, int, int]]:
    """The expert parameter an op multiplies by at argument ``arg`` (one of its rule's
    ``expert_weights``: a grouped matmul's 1), directly or transposed as transformers stores
    it ([E, N, K]) -> its dims for the op's (expert, K, N)."""
    w = node.args[arg]
    if isinstance(w, fx.Node) and w.name in params:
        return {w: (0, 1, 2)}
    if isinstance(w, fx.Node) and str(w.target) == TRANSPOSE and isinstance(w.args[0], fx.Node) \
            and w.args[0].name in params:
        order = list(range(w.args[0].meta["val"].dim()))
        a, b = (d % len(order) for d in w.args[1:3])
        order[a], order[b] = order[b], order[a]
        return {w.args[0]: tuple(order)}
    return {}


def router_linears(graph: StrategyGraph, found: dict[fx.Node, Linear] | None = None) -> set[fx.Node]:
    """The linears whose outputs reach a ``topk`` through single-input ops (softmax, casts):
    MoE routers, which score every expert for every token. ``found``: ``linears(graph)``."""
    found = linears(graph) if found is None else found
    routers = set()
    for node in graph.captured.nodes("call_function"):
        if str(node.target) != TOPK:
            continue
        source = node.args[0]
        while isinstance(source, fx.Node) and source.op == "call_function":
            if source in found:
                routers.add(source)
                break
            if len(source.all_input_nodes) != 1:
                break
            source = source.all_input_nodes[0]
    return routers
