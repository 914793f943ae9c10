"""A manual layout (``Hint``: its placements and ZeRO levels) and how it computes
(``computing_rules``): soft restrictions on a solver problem that keep each op to what the
layout's name promises. Megatron's tensor parallelism reads weights where they lie and keeps
the batch whole on its tp axes; data parallelism gathers weights, splits the work, and splits
values by their batch alone. Training (``intra_op``) and serving (``serving_layout``) complete
their layouts under the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.passes.costing import Costs
from autopar.passes.inference_costs import ServingCosts
from autopar.passes.planner.microbatch import batch_dims, batch_size, sequences_split
from autopar.passes.planner.untie import Restrictions
from autopar.passes.roles import AxisRole
from autopar.passes.rules.registry import restriction_of
from autopar.passes.strategy_graph import StrategyGraph, tensor_inputs


@dataclass
class Hint:
    """A manual layout: fixed placeholder placements (``fixed``) and ZeRO levels 0..2 per
    parameter; ``choice`` (a strategy per node) is filled in by ``complete`` unless given."""

    name: str
    choice: dict[fx.Node, int] | None = None
    zero: dict[fx.Node, int] = field(default_factory=dict)
    fixed: dict[fx.Node, tuple] = field(default_factory=dict)
    keep_axes: tuple[int, ...] = ()  # mesh axes on which parameters are used where they lie (Megatron)
    # mesh axes that split the data: ops reading a parameter use it whole there (gathered,
    # under FSDP) and split their work (else a tiny model "wins" by replicating everything)
    data_axes: tuple[int, ...] = ()
    # mesh axes that never split the batch (Megatron's and torchtitan's tp axis: activations
    # replicated across TP ranks, the batch split over the data-parallel axes only)
    batch_whole_axes: tuple[int, ...] = ()
    everything_whole: bool = False  # every op computes on whole values (the no-parallelism baseline)
    # the role of each mesh axis under the layout: ops whose rules restrict their strategies
    # under some roles keep to them (``autopar.passes.rules.registry.RestrictFn``: the experts
    # op dispatches all-to-all over ``ep`` axes); () restricts none
    roles: tuple[AxisRole, ...] = ()
    untied: list[str] = field(default_factory=list)  # what completing it gave up (tied layers split), for explain()
    notes: list[str] = field(default_factory=list)  # what the layout does to this model (linears split), for explain()


def computing_rules(costs: Costs | ServingCosts, hint: Hint) -> list[tuple[int, np.ndarray]]:
    """Soft restrictions on ``costs.problem``: how layout ``hint`` computes, as its name
    promises: with its weights where they lie (tp), gathered and the work split (dp axes),
    the batch kept whole on its tp axes and split by batch alone on its dp axes, each op
    within what its rule allows under the layout's roles. Training and serving share them."""
    graph = costs.graph
    replicated = tuple(Replicate() for _ in graph.mesh_shape)
    out = Restrictions()
    tables: dict[tuple, object] = {}  # per strategy table: the forbidden strategies
    if hint.keep_axes or hint.data_axes:  # how the layout computes with its weights
        weights = _weights_as_laid(graph, hint, replicated)
        for src, dst, position in costs.edge_inputs:
            if src not in weights:
                continue
            want = weights[src]
            # the work is split on the data axes where a weight is read, not where a view passes it on
            data_axes = hint.data_axes if dst not in weights else ()
            strategies = graph.nodes[dst].strategies
            key = ("uses", id(strategies), position, want, data_axes)
            if key not in tables:
                tables[key] = np.array([0.0 if s.inputs[position] is None or (
                    all(_used_where_it_lies(s.inputs[position][a], want[a]) for a in hint.keep_axes)
                    and all(isinstance(s.inputs[position][a], Replicate)
                            and not isinstance(s.outputs[0][a], Replicate) for a in data_axes)) else np.inf
                    for s in strategies])
            out.soft.append((costs.index[dst], tables[key]))  # an op with no such strategy moves the weight
    if hint.batch_whole_axes:
        # the same for every layout on these costs' graph (and its rebuilds): worked out once
        out.soft += costs.pricer.once(("batch kept whole", hint.batch_whole_axes),
                                      lambda: _batch_kept_whole(costs, hint.batch_whole_axes))
    if hint.data_axes:
        out.soft += costs.pricer.once(("batch only", hint.data_axes), lambda: _batch_only(costs, hint.data_axes))
    if hint.roles:  # what the ops' rules keep themselves to under these roles (``restrict``)
        for node, ns in graph.nodes.items():
            rule_restrict = restriction_of(node.target) if node.op == "call_function" else None
            if rule_restrict is not None and node in costs.index:
                keep = rule_restrict(ns.strategies, hint.roles)
                if keep is not None:
                    out.soft.append((costs.index[node], keep))
    if hint.everything_whole:
        for node, ns in graph.nodes.items():
            if node.op == "placeholder" or ns.follows is not None or node not in costs.index:
                continue
            key = ("whole", id(ns.strategies))
            if key not in tables:
                tables[key] = np.array([0.0 if all(p is None or all(isinstance(q, Replicate) for q in p)
                                                   for p in (*s.inputs, *s.outputs)) else np.inf
                                        for s in ns.strategies])
            out.soft.append((costs.index[node], tables[key]))
    return out.soft


def _batch_kept_whole(costs: Costs, axes: tuple[int, ...]) -> list[tuple[int, np.ndarray]]:
    """Soft restrictions: no op splits whole sequences over ``axes``: a dim made of the batch
    (``microbatch.batch_dims``) sharded there where its shards would cut the batch, as
    ``microbatch.batch_split`` counts them; so a micro-batch of one sequence per
    data-parallel replica stays valid."""
    graph, mesh = costs.graph, costs.graph.mesh_shape
    batch = batch_size(graph)
    dims = batch_dims(graph, batch) if batch else {}

    def cuts(source: fx.Node, i: int, spec) -> bool:
        return sequences_split(source, i, spec, dims, batch, mesh, axes) > 1

    return _forbidding(costs, cuts, lambda node, inputs: bool(dims.get(node) or any(dims.get(u) for u in inputs)),
                       lambda u: (tuple(dims.get(u, ())), _shapes(u)))


def _batch_only(costs: Costs, axes: tuple[int, ...]) -> list[tuple[int, np.ndarray]]:
    """Soft restrictions: over the data-parallel ``axes`` a value is split by its batch dims
    only (``microbatch.batch_dims``), as DDP and FSDP run it: each rank computes its own
    sequences, and what has no batch dim (a rotary table made from positions) whole; never a
    split along the sequence or the features, which the layout's name does not promise. The
    parameters and what is made of them alone (views, casts) are left to the layout's storage
    rules (FSDP stores them split and gathers them where they are used)."""
    graph = costs.graph
    batch = batch_size(graph)
    dims = batch_dims(graph, batch) if batch else {}
    weights = costs.pricer.once(("made of parameters",), lambda: _made_of_parameters(graph))

    def off_batch(source: fx.Node, i: int, spec) -> bool:
        if source in weights:
            return False
        held = dims.get(source)
        mine = held[i] if held and i < len(held) else frozenset()
        return spec is not None and any(isinstance(spec[a], Shard) and spec[a].dim not in mine for a in axes)

    return _forbidding(costs, off_batch, lambda node, inputs: node not in weights,
                       lambda u: (tuple(dims.get(u, ())), _shapes(u), u in weights))


def _forbidding(costs: Costs, bad, applies, value_key) -> list[tuple[int, np.ndarray]]:
    """Soft restrictions forbidding each op's strategies that place one of its values (an
    output as made, an input as read) where ``bad(value, output index, spec)`` says, for the
    ops ``applies(node, tensor inputs)`` names. Repeated layers share a table: keyed by the
    strategies and ``value_key`` of each value."""
    out, tables = [], {}
    for node, ns in costs.graph.nodes.items():
        if node.op == "placeholder" or ns.follows is not None or node not in costs.index:
            continue
        inputs = tensor_inputs(node)
        if not applies(node, inputs):
            continue
        key = (id(ns.strategies), *(value_key(u) for u in (node, *inputs)))
        if key not in tables:
            tables[key] = np.array([np.inf if any(bad(node, i, spec) for i, spec in enumerate(s.outputs))
                                    or any(bad(u, 0, spec) for u, spec in zip(inputs, s.inputs)) else 0.0
                                    for s in ns.strategies])
        if np.isinf(tables[key]).any():
            out.append((costs.index[node], tables[key]))
    return out


def _made_of_parameters(graph: StrategyGraph) -> set[fx.Node]:
    """The parameters' placeholders and every op whose tensor inputs are all among them."""
    params = graph.captured.params
    out: set[fx.Node] = set()
    for node in graph.captured.graph.nodes:
        if node.name in params:
            out.add(node)
        elif node.op == "call_function":
            inputs = tensor_inputs(node)
            if inputs and all(u in out for u in inputs):
                out.add(node)
    return out


def _shapes(node: fx.Node) -> tuple:
    """The shapes of ``node``'s tensor values (None for another value): what
    ``sequences_split`` reads of them, a cheap key (a tensor's printout costs a millisecond)."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in vals)


def _weights_as_laid(graph: StrategyGraph, hint: Hint, replicated: tuple) -> dict[fx.Node, tuple]:
    """Each parameter -> its placement under the layout, and each view of one (transformers
    stores expert weights [E, N, K] and transposes them for the grouped matmul) -> the placement
    that view gives it where it lies, when its strategies agree on one; so a layout's weights
    are used where they lie through their views too."""
    params = graph.captured.params
    out: dict[fx.Node, tuple] = {}
    for node, ns in graph.nodes.items():
        if node.name in params:
            out[node] = hint.fixed.get(node, replicated)
        elif (node.op == "call_function" and getattr(node.target, "is_view", False)
              and node.all_input_nodes and node.all_input_nodes[0] in out):
            want = out[node.all_input_nodes[0]]
            laid = {s.outputs[0] for s in ns.strategies if s.inputs and s.inputs[0] == want}
            if len(laid) == 1:
                out[node] = laid.pop()
    return out


def _used_where_it_lies(need, have) -> bool:
    """A parameter placed ``have`` on an axis is read there as it lies: as placed, or, when
    whole, as a pending sum (a row-parallel layer's bias is added once, after the reduction:
    Replicate -> Partial moves nothing)."""
    return need == have or (isinstance(have, Replicate) and isinstance(need, Partial))
