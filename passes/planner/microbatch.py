"""Micro-batches a pipeline plan can use: every micro-batch must divide over every mesh
axis that splits the batch anywhere in the plan.

A pipeline runs the intra-op strategies on micro-batches of ``batch / M`` sequences. A
strategy that shards a tensor dim made of the batch (the inputs' dim 0, the embedding's
output dim 0, a ``[batch * seq, hidden]`` view's dim 0, ...) over ``n`` devices needs that
dim's micro-batch size, ``(batch / M) * r`` for a dim of ``batch * r``, to divide by
``n``; so the micro-batch size must be a multiple of ``n / gcd(n, r)``. ``batch_split``
is the least common multiple of those over every node of the plan (the ids may stay
replicated while the embedding splits the batch: every activation counts).

The batch dims of every node (``batch_dims``) are found by following the batch from the
user inputs' dim 0: a view maps dims by ``view_groups`` (DTensor's own view rule); any
other op passes the batch to the output dims its own sharding rule splits where it splits
an input along a batch dim (so a [batch, heads, ...] value keeps heads apart from the batch
when there are as many of both), or, where the rule carries it nowhere (no rule, an op that
reduces the batch), to its output dims of a size its inputs' batch dims have; a tensor
built from shapes alone (a mask, made without the inputs' values) has a batch dim where a
dim's size is the batch.
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

import torch
from torch import fx
from torch.distributed.tensor import Shard
from torch.distributed.tensor._ops._view_ops import Flatten, InputDim, Split, view_groups

from autopar.passes.op_strategies import OpInfo
from autopar.passes.rules.registry import communicates, rule_for
from autopar.passes.strategy_graph import StrategyGraph, tensor_inputs

MAX_COUNTS = 16  # micro-batch counts tried per pipeline: the stage search runs once per count

_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
          torch.ops.aten.flatten.using_ints, torch.ops.aten.unflatten.int}  # same elements, dims regrouped


def batch_size(graph: StrategyGraph) -> int | None:
    """Dim 0 of the first user input with dims (the batch a pipeline splits), or None."""
    for node in graph.captured.nodes("placeholder"):
        val = node.meta.get("val")
        if node.name in graph.captured.user_inputs and isinstance(val, torch.Tensor) and val.ndim:
            return int(val.shape[0])
    return None


def batch_dims(graph: StrategyGraph, batch: int) -> dict[fx.Node, list[frozenset[int]]]:
    """Node -> per output, the tensor dims that are made of the batch (see module docstring);
    the capture alone decides them: worked out once for its graphs on every mesh (shared: read only)."""
    return graph.once(("batch dims", batch), lambda: _batch_dims(
        graph.captured, batch, {node: ns.info for node, ns in graph.nodes.items() if ns.info is not None}))


def _batch_dims(captured, batch: int, infos: dict[fx.Node, OpInfo]) -> dict[fx.Node, list[frozenset[int]]]:
    found: dict[fx.Node, list[frozenset[int]]] = {}
    shape_only: set[fx.Node] = set()  # built without any placeholder's values
    for node in captured.nodes():
        vals = _values(node)
        if node.op == "placeholder":
            if node.name in captured.user_inputs:
                found[node] = [frozenset({0}) if v is not None and v.ndim and v.shape[0] == batch else frozenset()
                               for v in vals]
            continue
        if node.op != "call_function":
            continue
        sources = tensor_inputs(node)
        if node.target is operator.getitem and sources and sources[0] in found:
            found[node] = [found[sources[0]][node.args[1]]] if node.args[1] < len(found[sources[0]]) else []
            continue
        if all(u in shape_only for u in sources):
            shape_only.add(node)
            found[node] = [frozenset(d for d, s in enumerate(v.shape) if s == batch) if v is not None else frozenset()
                           for v in vals]
            continue
        carried = [(u, i, dims) for u in sources if u in found for i, dims in enumerate(found[u]) if dims]
        if not carried:
            continue
        if node.target in _VIEWS and len(vals) == 1 and vals[0] is not None:
            source = _values(sources[0])[0]
            found[node] = [_view_batch_dims(tuple(source.shape), tuple(vals[0].shape), found[sources[0]][0], batch)]
            continue
        ruled = _through_rule(infos.get(node), sources, found, len(vals)) if batch > 1 else None
        if ruled is not None:
            found[node] = ruled
            continue
        sizes = {int(_values(u)[i].shape[d]) for u, i, dims in carried for d in dims}
        found[node] = [frozenset(d for d, s in enumerate(v.shape) if s in sizes) if v is not None else frozenset()
                       for v in vals]
    return found


def _through_rule(info: OpInfo | None, sources: list[fx.Node], found: dict[fx.Node, list[frozenset[int]]],
                  outputs: int) -> list[frozenset[int]] | None:
    """Per output, the dims the op's sharding rule splits where one of its options splits an
    input along that input's batch dim (one mesh axis, as DTensor propagates a split); None
    where the op has no rule, its inputs do not line up with the graph's, or no option carries
    the batch to an output (a batch of one, a reduction over it: sizes decide instead)."""
    rule = rule_for(info.op) if info is not None else None
    if rule is None or len(info.inputs) != len(sources):
        return None
    held = [found[u][0] if u in found and found[u] else frozenset() for u in sources]
    out: list[set[int]] = [set() for _ in range(outputs)]
    for option in rule.options(info):
        if communicates(option.kernel):  # it moves rows between dims (a gather inside a linear)
            continue
        if any(isinstance(p, Shard) and p.dim in dims for p, dims in zip(option.inputs, held)):
            for k, q in enumerate(option.outputs[:outputs]):
                if isinstance(q, Shard):
                    out[k].add(q.dim)
    return [frozenset(d) for d in out] if any(out) else None


def batch_split(graph: StrategyGraph, choice: dict[fx.Node, int], batch: int,
                dims: dict[fx.Node, list[frozenset[int]]] | None = None, known: dict | None = None) -> int:
    """The number a micro-batch's sequence count must be a multiple of under ``choice``.
    ``known``: each (node, strategy)'s own number, kept between calls on one graph, batch and
    ``dims`` (the choices of one graph's candidate plans differ in few nodes)."""
    dims = batch_dims(graph, batch) if dims is None else dims
    known = {} if known is None else known
    inputs = graph.once(("tensor inputs",),
                        lambda: {node: tensor_inputs(node) for node in graph.captured.gm.graph.nodes})
    need = 1
    for node, ns in graph.nodes.items():
        if ns.follows is not None or node not in choice:
            continue  # a getitem's placement is its producer's output
        if (key := (node, choice[node])) not in known:
            known[key] = _strategy_split(node, inputs[node], ns.strategies[choice[node]], dims, batch,
                                         graph.mesh_shape)
        need = math.lcm(need, known[key])
    return need


def _strategy_split(node: fx.Node, inputs: list[fx.Node], strategy, dims: dict, batch: int,
                    mesh: Sequence[int]) -> int:
    """``batch_split``'s number for ``node`` alone (``inputs``: its ``tensor_inputs``), as
    ``strategy`` makes and reads its values."""
    specs = [(node, i, spec) for i, spec in enumerate(strategy.outputs)]
    specs += [(u, 0, spec) for u, spec in zip(inputs, strategy.inputs) if spec is not None]
    return math.lcm(*(sequences_split(source, i, spec, dims, batch, mesh) for source, i, spec in specs))


def sequences_split(source: fx.Node, i: int, spec, dims: dict[fx.Node, list[frozenset[int]]], batch: int,
                    mesh: Sequence[int], axes: Sequence[int] | None = None) -> int:
    """The number a micro-batch's sequence count must be a multiple of for output ``i`` of
    ``source`` placed as ``spec`` (1: it splits no whole sequences): its batch dims' shards
    over the mesh (or only over ``axes``), a dim of ``batch * r`` needing ``n / gcd(n, r)``."""
    held = dims.get(source)
    if spec is None or not held or i >= len(held) or not held[i]:
        return 1
    shape = _values(source)[i].shape
    axes = range(len(mesh)) if axes is None else axes
    need = 1
    for d in held[i]:
        n = math.prod(mesh[a] for a in axes if isinstance(spec[a], Shard) and spec[a].dim == d)
        r = int(shape[d]) // batch if int(shape[d]) % batch == 0 else 1
        need = math.lcm(need, n // math.gcd(n, r))
    return need


def valid_counts(batch: int, split: int, limit: int = MAX_COUNTS) -> list[int]:
    """Micro-batch counts M (divisors of ``batch``) whose micro-batches are multiples of
    ``split`` sequences; at most ``limit`` of them, spread evenly on a log scale (1 and
    the largest always in). No micro-batch of one sequence out of several: the runtime
    captures the model at micro-batch size, and torch.export specialises a dim of size 1
    (an ``expand`` over the batch disappears), so that graph's nodes are not the ones the
    plan names (the 70B plan with M=16 over 16 sequences failed its dry run so)."""
    counts = [m for m in range(1, batch + 1)
              if batch % m == 0 and (batch // m) % split == 0 and (batch // m > 1 or batch == 1)]
    if len(counts) <= limit:
        return counts
    picks = {counts[round(i * (len(counts) - 1) / (limit - 1))] for i in range(limit)}
    return sorted(picks)


def _values(node: fx.Node) -> list[torch.Tensor | None]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [v if isinstance(v, torch.Tensor) else None for v in vals]


def _view_batch_dims(source: Sequence[int], target: Sequence[int], dims: frozenset[int], batch: int) -> frozenset[int]:
    """The target dims of a view made of the source's batch dims (a merge holds the batch
    when one of its parts does; of a split, the first part whose size the batch divides)."""
    def carries(spec) -> bool:
        if isinstance(spec, InputDim):
            return spec.input_dim in dims
        if isinstance(spec, Flatten):
            return any(carries(s) for s in spec.input_dims)
        return False

    out = set()
    for d, spec in enumerate(view_groups(list(source), list(target))):
        if isinstance(spec, Split):
            if carries(spec.input_dim):
                first = next((i for i, g in enumerate(spec.group_shape) if g % batch == 0), 0)
                if spec.split_id == first:
                    out.add(d)
        elif carries(spec):
            out.add(d)
    return frozenset(out)
