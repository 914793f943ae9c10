"""The strategy graph: every node of a captured graph with all the ways it can be sharded.

- a placeholder (parameter, buffer, input) may be laid out in any placement whose shards
  divide evenly, except Partial (a whole value is not a pending sum);
- an op node gets the strategies of its rule (``autopar.passes.rules``), or only the
  replicated one, with one warning per op that has no rule;
- a ``getitem`` of a multi-output op follows its producer: it has the producer's
  strategies, taking the chosen output's placement;
- an in-place write (``copy_``, ``fill_``, ... into a view of a value) must land in the
  tensor later readers read: the edges from the value it writes into, through the views
  it is taken from, to the writer are kept where their values lie (``StrategyGraph.in_place``):
  the solver's problem makes each reader on the path follow its value
  (``in_place_choices``) and forbids every other pair (``in_place_mask``, in the edge's
  table; ``autopar.passes.costing``).
"""

from __future__ import annotations

import itertools
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor import Replicate, Shard
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils import _pytree as pytree

from autopar.passes import rules
from autopar.passes.rules.random import RANDOM_OPS
from autopar.passes.capture import Captured
from autopar.passes.placements import Spec, fits
from autopar.passes.op_strategies import OpInfo, ShardingStrategy, TensorMeta


class NoRuleWarning(UserWarning):
    """An op without a sharding rule: it runs replicated."""


def op_info(node: fx.Node) -> OpInfo:
    """The OpInfo of a call_function node, from the shapes export recorded in meta["val"]."""

    def to_meta(x: Any) -> Any:
        if isinstance(x, fx.Node):
            val = x.meta.get("val")
            return TensorMeta.of(val) if isinstance(val, torch.Tensor) else val
        return x

    args = pytree.tree_map(to_meta, node.args)
    kwargs = pytree.tree_map(to_meta, dict(node.kwargs))
    outs = tuple(
        TensorMeta.of(v) for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)
    )
    return OpInfo(node.target, tuple(args), kwargs, outs)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes behind a call's tensor arguments, in OpInfo.inputs order (``pytree.tree_leaves``'
    order of ``(node.args, node.kwargs)``; the planner asks this of every node many times, so
    the plain lists, tuples and dicts fx keeps arguments in are walked here without pytree)."""
    leaves = [*node.args, *node.kwargs.values()]  # already the leaves unless an argument nests
    if any(isinstance(a, (list, tuple, dict)) or type(a) in pytree.SUPPORTED_NODES for a in leaves):
        leaves = []
        if not _plain_leaves(node.args, leaves) or not _plain_leaves(node.kwargs, leaves):
            leaves = pytree.tree_leaves((node.args, dict(node.kwargs)))
    return [x for x in leaves if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)]


_PLAIN_SEQUENCES = (list, tuple, immutable_list)
_PLAIN_MAPPINGS = (dict, immutable_dict)


def _plain_leaves(value: Any, out: list) -> bool:
    """Appends ``value``'s pytree leaves to ``out`` in ``pytree.tree_leaves``' order, walking plain
    lists, tuples and dicts (a dict by its values in insertion order, as pytree flattens one);
    False at any other container pytree knows (a named tuple, an ``OrderedDict``): the caller
    asks pytree then."""
    kind = type(value)
    if kind in _PLAIN_SEQUENCES:
        return all(_plain_leaves(v, out) for v in value)
    if kind in _PLAIN_MAPPINGS:
        return all(_plain_leaves(v, out) for v in value.values())
    if kind in pytree.SUPPORTED_NODES or isinstance(value, (tuple, list, dict)):
        return False
    out.append(value)
    return True


def aliases_first(node: fx.Node) -> tuple[bool, bool]:
    """(the op's output is a view of its first argument, the op writes into that argument),
    from its schema's alias annotations (``slice``: (True, False); ``copy_``: (True, True))."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    alias = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
    return alias is not None, alias is not None and alias.is_write


def write_path(writer: fx.Node) -> list[fx.Node]:
    """An in-place write and the values it writes into: the writer, its destination, the
    value that one is a view of, and so on back to the base (the first value that is no
    view); [] for an op that writes nothing in place."""
    aliases, writes = aliases_first(writer)
    if not (aliases and writes) or not tensor_inputs(writer):
        return []
    path = [writer]
    while aliases_first(path[-1])[0] and tensor_inputs(path[-1]):
        path.append(tensor_inputs(path[-1])[0])
    return path


def read_after(path: list[fx.Node], position: dict[fx.Node, int]) -> list[fx.Node]:
    """The readers of a write path's values that run after its writer (``position``: the
    graph's order): they must read what was written."""
    writer = path[0]
    return [u for n in path[1:] for u in n.users if position.get(u, -1) > position[writer]]


def in_place_edges(graph: fx.Graph) -> frozenset[tuple[fx.Node, fx.Node]]:
    """(value, reader) edges that must read their value where it lies: along the path of
    every in-place write whose values something reads afterwards (``write_path``), or that
    writes into a placeholder (state the next call reads: a static key-value cache), each
    link from a value to the view or writer taken from it. Moved, the link would hand the
    writer a copy, and the readers after it would read the unwritten value."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    edges = set()
    for node in graph.nodes:
        path = write_path(node)
        # a write into a placeholder (a static cache's buffer) is read by the program's next call
        if path and (read_after(path, position) or path[-1].op == "placeholder"):
            edges.update((value, reader) for reader, value in zip(path, path[1:]))
    return frozenset(edges)


def placeholder_specs(shape: Sequence[int], mesh_shape: Sequence[int]) -> list[Spec]:
    per_axis = [Replicate()] + [Shard(d) for d in range(len(shape))]
    specs = [s for s in itertools.product(per_axis, repeat=len(mesh_shape)) if fits(shape, s, mesh_shape)]
    return specs


@dataclass
class NodeStrategies:
    node: fx.Node
    strategies: tuple[ShardingStrategy, ...]  # shared between identical calls: never mutate
    info: OpInfo | None = None  # None for placeholders and getitems
    follows: tuple[fx.Node, int] | None = None  # getitem: (producer, output index)
    has_rule: bool = True


@dataclass
class StrategyGraph:
    captured: Captured
    mesh_shape: tuple[int, ...]
    nodes: dict[fx.Node, NodeStrategies] = field(default_factory=dict)
    missing_rules: dict[str, int] = field(default_factory=dict)  # op -> node count
    # (value, reader) edges on an in-place write's path (``in_place_edges``): read where it lies
    in_place: frozenset[tuple[fx.Node, fx.Node]] = frozenset()
    # what depends on the capture alone, not the mesh (``once``): shared by the graphs of one
    # capture that ``build_strategy_graph`` is given the same ``shared`` dict for
    shared: dict[tuple, Any] = field(default_factory=dict, repr=False)

    def __getitem__(self, node: fx.Node) -> NodeStrategies:
        return self.nodes[node]

    def once(self, key: tuple, make):
        """``make()``, worked out once per capture: ``make`` must read the capture alone (its
        nodes, shapes and rules' one-axis options), never the mesh; the result is shared, never
        to be changed."""
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]

    def output_specs(self, node: fx.Node) -> list[Spec]:
        """The placement ``node``'s value takes under each of its strategies (a ``getitem``: its
        producer's, at its output)."""
        ns = self.nodes[node]
        out = ns.follows[1] if ns.follows is not None else 0
        return [s.outputs[out] for s in ns.strategies]

    def in_place_mask(self, value: fx.Node, reader: fx.Node) -> np.ndarray:
        """[strategies of ``value``, strategies of ``reader``]: 0 where the reader's strategy
        takes its first input where ``value`` lies (or does not read it), inf where it would
        read a moved copy. Added to the edge's resharding table, it keeps an in-place write's
        path unmoved (``in_place``)."""
        have = self.output_specs(value)
        needs = [s.inputs[0] if s.inputs else None for s in self.nodes[reader].strategies]
        return np.array([[0.0 if need is None or need == h else np.inf for need in needs] for h in have])

    def in_place_choices(self, value: fx.Node, reader: fx.Node, preference: np.ndarray) -> tuple[int, ...]:
        """Per strategy of ``value``, the strategy of ``reader`` that takes it where it lies, the
        least ``preference`` (e.g. its time) first: the reader follows its value. Where none
        does, 0, a pair ``in_place_mask`` forbids: that strategy of ``value`` is not taken."""
        allowed = np.isfinite(self.in_place_mask(value, reader))
        ranked = np.where(allowed, np.asarray(preference, dtype=float)[None, :], np.inf)
        best = ranked.argmin(axis=1)
        return tuple(int(j) if np.isfinite(row[j]) else 0 for row, j in zip(ranked, best))

    def counts(self) -> dict[str, list[int]]:
        """Op name -> number of strategies of each of its nodes."""
        out: dict[str, list[int]] = {}
        for ns in self.nodes.values():
            if ns.info is not None:
                out.setdefault(ns.info.name, []).append(len(ns.strategies))
        return out

    def table(self) -> str:
        """One line per node: name, op, number of strategies, and the first few."""
        lines = []
        for node, ns in self.nodes.items():
            target = "input" if node.op == "placeholder" else str(node.target)
            shown = ", ".join(str(s) for s in ns.strategies[:3])
            more = f" … (+{len(ns.strategies) - 3})" if len(ns.strategies) > 3 else ""
            lines.append(f"{node.name:<28} {target:<38} {len(ns.strategies):>4}  {shown}{more}")
        return "\n".join(lines)


def unkeyed_random(node: fx.Node) -> ValueError:
    """A random op the runtime cannot draw layout-independently: it would read each rank's own
    generator, and replicated copies of its output would differ between ranks."""
    keyed = ", ".join(sorted(str(op) for op in RANDOM_OPS))
    return ValueError(
        f"autopar: {node.target} (node {node.name}) draws from torch's generator, which differs between ranks seeded "
        f"apart, so its copies would silently disagree; expected one of the random ops autopar keys ({keyed}); draw "
        "the values outside the model and pass them as an input, or use one of those ops")


def build_strategy_graph(captured: Captured, mesh_shape: Sequence[int],
                         calls: dict[fx.Node, tuple[OpInfo, str]] | None = None,
                         shared: dict[tuple, Any] | None = None) -> StrategyGraph:
    """Every node's strategies on ``mesh_shape``. ``calls``: a dict kept between graphs of the
    same captured model on several meshes (a planner's factorisations), where each call's
    OpInfo and key, which do not depend on the mesh, are kept once worked out; ``shared``: a
    dict kept between them too, for what else depends on the capture alone
    (``StrategyGraph.once``)."""
    calls = {} if calls is None else calls
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if any(s < 1 for s in mesh_shape):  # () is one device: a pipeline stage with no intra-op axes
        raise ValueError(f"autopar: expected a mesh shape of positive sizes such as (2, 2), found {mesh_shape}")
    graph = StrategyGraph(captured, mesh_shape, shared={} if shared is None else shared)
    # Repeated layers repeat the same calls: list each distinct call's strategies once.
    known: dict[str, tuple[ShardingStrategy, ...]] = {}
    for node in captured.nodes():
        val = node.meta.get("val")
        if node.op == "placeholder":
            if isinstance(val, torch.Tensor):
                key = repr(("placeholder", tuple(val.shape)))
                if key not in known:
                    known[key] = tuple(ShardingStrategy((), (s,)) for s in placeholder_specs(val.shape, mesh_shape))
                graph.nodes[node] = NodeStrategies(node, known[key])
        elif node.op == "call_function" and node.target is operator.getitem:
            producer, index = node.args
            if producer in graph.nodes:
                graph.nodes[node] = NodeStrategies(
                    node, graph.nodes[producer].strategies, follows=(producer, index)
                )
        elif node.op == "call_function":
            if node not in calls:
                info = op_info(node)
                calls[node] = info, repr((info.name, info.args, info.kwargs, info.outputs))
            info, key = calls[node]
            has_rule = rules.rule_for(node.target) is not None
            if not has_rule and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
                raise unkeyed_random(node)
            if not has_rule:
                graph.missing_rules[info.name] = graph.missing_rules.get(info.name, 0) + 1
            if key not in known:
                known[key] = tuple(rules.strategies_for(info, mesh_shape))
            graph.nodes[node] = NodeStrategies(node, known[key], info=info, has_rule=has_rule)
    graph.in_place = in_place_edges(captured.graph)
    for name, count in graph.missing_rules.items():
        warnings.warn(
            f"autopar: no sharding rule for {name} ({count} node(s) in {captured.model_name}); "
            "it runs replicated. Add a rule in passes/rules/ to let it be split.",
            NoRuleWarning,
            stacklevel=2,
        )
    return graph
