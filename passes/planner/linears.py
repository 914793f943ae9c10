"""Linears recognised by their math, not their spelling.

A linear is a contraction of an activation with a parameter whose output features are
the output's last dim: ``y[..., n] = sum_k x[..., k] w[k, n]``, whether it is written
``F.linear(x, w)``, ``x @ w.T`` (``numpy_T``/``t``/``permute`` + ``matmul``), ``addmm``
with a weight stored [in, out], ``bmm`` against an expanded weight, or ``einsum``. The
op's rule says which (``autopar.passes.rules``; a contraction's rule is its einsum
equation): in its one-axis options, the weight split on its contracted dim gives a
pending sum (row parallelism) together with the activation split on its own; split on
an output-features dim with the activation whole it gives the output split on its last
dim (column parallelism). The weight may be reached through views, transposes, expands
and casts; their rules' options map its dims back to the parameter's. A convolution
(features on dim 1) is no linear here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.passes import rules
from autopar.passes.op_strategies import AxisOption
from autopar.passes.rules.registry import communicates
from autopar.passes.strategy_graph import StrategyGraph, tensor_inputs


@dataclass(frozen=True)
class Linear:
    """One linear: the activation it reads, its weight parameter, and the parameter's dims
    Megatron splits (None where its views fold that dim into another)."""

    x: fx.Node
    weight: fx.Node
    column: int | None  # the weight's output-features dim
    row: int | None  # the weight's contracted dim
    bias: fx.Node | None = None  # a parameter added to the product, split with the output features
    bias_dim: int | None = None


def linears(graph: StrategyGraph) -> dict[fx.Node, Linear]:
    """Every op of ``graph`` that is a linear with a parameter weight, in graph order (read
    off the rules' one-axis options: the same on every mesh, worked out once; read only)."""
    return graph.once(("linears",), lambda: _linears(graph))


def _linears(graph: StrategyGraph) -> dict[fx.Node, Linear]:
    sources = _ParameterSources(graph)
    out = {}
    for node in graph.captured.nodes("call_function"):
        found = _linear(graph, node, sources)
        if found is not None:
            out[node] = found
    return out


def options(graph: StrategyGraph, node: fx.Node) -> list[AxisOption]:
    """The one-axis options of ``node``'s rule ([] without one): its sharding on a mesh axis
    of any size, whether or not its dims divide by it. Not those of a kernel that trades
    with its peers: it moves rows between dims (a gather inside a linear), so its shards say
    nothing of how the op's dims carry over."""
    ns = graph.nodes.get(node)
    rule = rules.rule_for(node.target) if node.op == "call_function" else None
    if rule is None or ns is None or ns.info is None:
        return []
    return [o for o in rule.options(ns.info) if not communicates(o.kernel)]


class _ParameterSources:
    """The parameter a value is a view of (through ops of one tensor input), with the map
    from the value's dims to the parameter's; memoised per graph."""

    def __init__(self, graph: StrategyGraph):
        self.graph = graph
        self.params = graph.captured.params
        self.known: dict[fx.Node, tuple[fx.Node, dict[int, int]] | None] = {}

    def __call__(self, node: fx.Node) -> tuple[fx.Node, dict[int, int]] | None:
        if node in self.known:
            return self.known[node]
        chain, found = [], None
        while True:
            if node in self.known:
                found = self.known[node]
                break
            if node.op == "placeholder":
                val = node.meta.get("val")
                found = (node, {d: d for d in range(val.dim())}) if node.name in self.params else None
                break
            ins = node.all_input_nodes if node.op == "call_function" else []
            if len(ins) != 1:
                break
            chain.append(node)
            node = ins[0]
        for view in reversed(chain):  # from the parameter's end
            if found is not None:
                found = (found[0], {o: found[1][i] for o, i in _dim_map(self.graph, view).items() if i in found[1]})
            self.known[view] = found
        return found


def _dim_map(graph: StrategyGraph, node: fx.Node) -> dict[int, int]:
    """Output dim -> input dim that one shard carries over to, by the node's rule."""
    return {o.outputs[0].dim: o.inputs[0].dim for o in options(graph, node)
            if o.inputs and isinstance(o.inputs[0], Shard) and isinstance(o.outputs[0], Shard)}


def _linear(graph: StrategyGraph, node: fx.Node, sources: _ParameterSources) -> Linear | None:
    if len(node.all_input_nodes) < 2 or not any(sources(n) for n in node.all_input_nodes):
        return None
    ins = tensor_inputs(node)  # in the order of the rule's placements
    traced = [sources(n) for n in ins]
    opts = options(graph, node)
    last = node.meta["val"].dim() - 1 if hasattr(node.meta.get("val"), "dim") else None
    for p in reversed(range(len(ins))):  # the weight: the last operand that is a parameter (x @ w)
        if traced[p] is None:
            continue
        for row in opts:  # the weight split on a contracted dim, with one other operand: the activation
            shards = [q for q, pl in enumerate(row.inputs) if isinstance(pl, Shard)]
            if not isinstance(row.outputs[0], Partial) or p not in shards or len(shards) != 2:
                continue
            x = next(q for q in shards if q != p)
            column = next((o for o in opts if isinstance(o.inputs[p], Shard) and isinstance(o.inputs[x], Replicate)
                           and o.outputs[0] == Shard(last)), None)
            if column is None:
                continue
            param, dims = traced[p]
            bias, bias_dim = _bias(column, (p, x), traced)
            return Linear(ins[x], param, dims.get(column.inputs[p].dim), dims.get(row.inputs[p].dim), bias, bias_dim)
    return None


def _bias(column: AxisOption, operands: tuple[int, int], traced) -> tuple[fx.Node | None, int | None]:
    """A parameter the column option splits beside the weight: a bias added to the product."""
    for q, pl in enumerate(column.inputs):
        if q not in operands and isinstance(pl, Shard) and traced[q] is not None:
            param, dims = traced[q]
            return param, dims.get(pl.dim)
    return None, None
