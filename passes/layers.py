"""Repeated layers: which layer each node belongs to, and which layers are identical.

A node belongs to layer ``i`` of a container when its ``nn_module_stack`` (or, for a
parameter, its qualified name) has a path ``<container>.<i>``, e.g.
``model.layers.3.mlp``. Layers are numbered in graph order. Identical layers (same
ops, same strategy tables, inputs from the same relative places, same parameter
shapes) are tied: the solver gives them one set of variables.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from torch import fx

from autopar.passes.strategy_graph import StrategyGraph


_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def layer_path(node: fx.Node, params: dict[str, str]) -> tuple[str, int] | None:
    """(container path, layer index) of a node inside a repeated layer, e.g. ("model.layers", 3)."""
    if node.op == "placeholder":
        match = _LAYER.match(params.get(node.name, ""))
        return (match.group(1), int(match.group(2))) if match else None
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        match = _LAYER.match(path)
        if match:
            return match.group(1), int(match.group(2))
    return None


def segments(nodes: Iterable[fx.Node], params: Mapping[str, str]) -> dict[fx.Node, tuple]:
    """Op -> its segment, in the order of ``nodes``: ``("layer", container, index)`` inside a
    repeated layer, ``("between", k)`` in the k-th stretch between layers (0: before the
    first). ZeRO buckets gather and reduce a segment at a time
    (``autopar.passes.lowering.codegen.plan_buckets``)."""
    out, current, between = {}, ("between", 0), 0
    for node in nodes:
        if node.op != "call_function":
            continue
        where = layer_path(node, params)
        if where is not None:
            current = ("layer", *where)
        elif current[0] == "layer":
            between += 1
            current = ("between", between)
        out[node] = current
    return out


def first_segments(nodes: Iterable[fx.Node], params: Mapping[str, str]) -> dict[fx.Node, int]:
    """Parameter placeholder -> the number, in graph order, of the segment its first reader is
    in: the bucket forward gathers it with (a parameter no op reads: absent)."""
    nodes = list(nodes)
    segment = segments(nodes, params)
    number: dict[tuple, int] = {}
    for key in segment.values():
        number.setdefault(key, len(number))
    out = {}
    for node in nodes:
        if node.op == "placeholder" and node.name in params:
            read = [number[segment[u]] for u in node.users if u in segment]
            if read:
                out[node] = min(read)  # segments are numbered in graph order
    return out


def first_segments_of(graph: StrategyGraph) -> dict[fx.Node, int]:
    """``first_segments`` of the graph's captured program, worked out once per graph."""
    captured = graph.captured
    return graph.once(("first segments",), lambda: first_segments(captured.gm.graph.nodes, captured.params))


def find_layers(graph: StrategyGraph, index: dict[fx.Node, int], zero_node: dict[fx.Node, int]):
    """Layer index of every node in a repeated layer, and tie groups across identical layers.

    Layers of one container are identical when their op nodes, in graph order, call the
    same ops with the same strategy tables and read inputs from the same relative places,
    and their parameters have the same shapes; only identical layers are tied.
    """
    params = graph.captured.params
    members: dict[tuple[str, int], list[fx.Node]] = {}
    for node, ns in graph.nodes.items():
        where = layer_path(node, params)
        if where is not None and (node.op != "placeholder" or node.name in params):
            members.setdefault(where, []).append(node)
    positions = {n: i for i, n in enumerate(graph.nodes)}
    order = {where: k for k, where in enumerate(sorted(members, key=lambda w: _first(positions, members[w])))}
    layer_of = {n: order[where] for where, group in members.items() for n in group}
    by_container: dict[str, list[tuple[int, list[fx.Node]]]] = {}
    for (container, i), group in sorted(members.items(), key=lambda kv: kv[0]):
        by_container.setdefault(container, []).append((i, group))
    ties: list[list[int]] = []
    for layers in by_container.values():
        signatures = [_signature(graph, group) for _, group in layers]
        classes: dict[tuple, list[list[fx.Node]]] = {}
        for sig, (_, group) in zip(signatures, layers):
            classes.setdefault(sig, []).append(group)
        for groups in classes.values():
            if len(groups) < 2:
                continue
            for position in range(len(groups[0])):
                first = groups[0][position]
                if graph.nodes[first].follows is not None:
                    continue  # followers are tied through their leaders
                ties.append([zero_node.get(g[position], index[g[position]]) for g in groups])
    return layer_of, ties


def _first(positions: dict[fx.Node, int], group: list[fx.Node]) -> int:
    """Position in graph order of a layer's first op (placeholders all come first)."""
    ops = [positions[n] for n in group if n.op != "placeholder"]
    return min(ops) if ops else min(positions[n] for n in group)


def _signature(graph: StrategyGraph, group: list[fx.Node]) -> tuple:
    local = {n: i for i, n in enumerate(group)}
    sig = []
    for node in group:
        ns = graph.nodes[node]
        if node.op == "placeholder":
            sig.append(("param", tuple(node.meta["val"].shape), node.meta["val"].dtype, id(ns.strategies)))
            continue
        inputs = tuple(("in", local[a]) if a in local else ("out", a.name if a.op == "placeholder" and
                                                              a.name not in graph.captured.params else "ext")
                       for a in node.all_input_nodes)
        sig.append((str(node.target), id(ns.strategies), ns.follows[1] if ns.follows else None, inputs))
    return tuple(sig)
