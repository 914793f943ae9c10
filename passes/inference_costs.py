"""Costing of a serving program: a strategy graph and a profile -> the solver's problem of one
forward step, with nothing kept for a backward.

Serving holds the weights and the key-value cache, and computes one step at a time:

    time    = the op's forward alone, on local shapes (the roofline ``compute_time``: decode's
              matmuls of one token per sequence are priced by the weight bytes they read,
              attention by the cache it reads; every kernel pays the profile's launch
              latency), plus the collectives the op runs inside itself, and for the step's
              outputs (the logits) bringing them whole to every rank, as the runtime does;
    edges   = the forward move of each value to where its consumer reads it (no gradient:
              a tensor-parallel all-reduce, latency-bound at decode's sizes, is priced by the
              profile's fit of its size);
    memory  = what a placeholder holds as placed: weights in their own dtype and the cache
              (no gradients, no optimizer state, no ZeRO: weights gathered for each step
              would be paid on every token). A step's activations live only while it runs:
              ``step_activation_bytes`` walks one program on its chosen layout.

Identical repeated layers are tied as in training (``autopar.passes.layers.find_layers``);
views and unary ops follow their operand; readers on an in-place write's path (the cache's
``index_copy_``) follow the value they write into.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from torch import fx
from torch.distributed.tensor import Replicate
from torch.utils import _pytree as pytree

from autopar import costmodels
from autopar.passes.costing import Pricer, leader_of
from autopar.passes.edge_costs import EdgeInput, alike_consumers, edge_tables, local_bytes
from autopar.passes.layers import find_layers
from autopar.passes.op_strategies import TensorMeta
from autopar.passes.placements import local_shape
from autopar.passes.solve import Follower, SolveProblem
from autopar.passes.strategy_graph import StrategyGraph, aliases_first, tensor_inputs


@dataclass
class ServingCosts:
    """One serving program's problem and the pieces its prediction reads."""

    graph: StrategyGraph
    profile: costmodels.HardwareProfile
    problem: SolveProblem
    nodes: list[fx.Node]  # problem index -> graph node
    index: dict[fx.Node, int]
    compute: list[np.ndarray]  # forward seconds per strategy (the op's own collectives included)
    held: list[np.ndarray]  # bytes a placeholder holds per placement (weights, cache, inputs); zeros for ops
    edge_inputs: list[tuple[fx.Node, fx.Node, int]]
    edge_prices: list[EdgeInput]
    pricer: Pricer

    def choice(self, assignment) -> dict[fx.Node, int]:
        return {node: int(assignment[i]) for node, i in self.index.items()}

    def state_bytes(self, assignment, names: set[str]) -> float:
        """Bytes per device the placeholders called ``names`` hold under ``assignment``."""
        return float(sum(self.held[i][assignment[i]] for node, i in self.index.items() if node.name in names))

    def communication(self, assignment) -> float:
        """Seconds of the assignment's moves between ops (the edges)."""
        return float(sum(r[assignment[u], assignment[v]] for u, v, r in self.problem.edges))


def build_serving_costs(graph: StrategyGraph, profile: costmodels.HardwareProfile,
                        pricer: Pricer | None = None) -> ServingCosts:
    """The problem of one forward step of ``graph`` on ``profile`` (the module docstring)."""
    if tuple(profile.mesh_shape) != graph.mesh_shape:
        raise ValueError(
            f"autopar: the hardware profile is for mesh {profile.mesh_shape}, the strategy graph for "
            f"{graph.mesh_shape}; build both for the same mesh shape")
    pricer = pricer if pricer is not None else Pricer(graph, profile)
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    outputs = _step_outputs(graph)
    compute, held, followers = [], [], []
    for node in nodes:
        ns = graph.nodes[node]
        k = len(ns.strategies)
        if ns.follows is not None:
            followers.append(Follower(index[node], index[ns.follows[0]], tuple(range(k))))
            compute.append(np.zeros(k))
            held.append(np.zeros(k))
        elif node.op == "placeholder":
            meta = TensorMeta.of(node.meta["val"])
            compute.append(np.zeros(k))
            held.append(np.array([local_bytes(meta, s.output, graph.mesh_shape) for s in ns.strategies]))
        else:
            _, forward, _ = pricer.op(ns, False)
            t = forward + pricer.op_comm(ns, False)
            if node in outputs:  # the runtime makes the step's outputs (the logits) whole on every rank
                t = t + _made_whole(node, ns, profile)
            compute.append(t)
            held.append(np.zeros(k))
            leader = leader_of(graph, node, t, pricer)
            if leader is not None:
                followers.append(Follower(index[node], index[leader[0]], leader[1]))
    layer_of, ties = find_layers(graph, index, {})
    alike = alike_consumers(graph, nodes, graph.captured.params)
    edges, edge_inputs, edge_prices = edge_tables(graph, nodes, index, set(), {}, alike, pricer, training=False)
    led = {f.node for f in followers}
    ties = [group for group in ([v for v in g if v not in led] for g in ties) if len(group) > 1]
    problem = SolveProblem(node_time=compute, node_memory=held, edges=edges, ties=ties, followers=followers,
                           node_names=[n.name for n in nodes])
    return ServingCosts(graph, profile, problem, nodes, index, compute, held, edge_inputs, edge_prices, pricer)


def _step_outputs(graph: StrategyGraph) -> set[fx.Node]:
    out = next(n for n in graph.captured.graph.nodes if n.op == "output")
    return {v for v in pytree.tree_leaves(out.args[0]) if isinstance(v, fx.Node) and v in graph.nodes}


def _made_whole(node: fx.Node, ns, profile: costmodels.HardwareProfile) -> np.ndarray:
    """Seconds, per strategy, to bring ``node``'s output from where it lies to replicated on
    every device (a partial sum all-reduced, a split gathered)."""
    val = node.meta["val"]
    whole = (Replicate(),) * len(profile.mesh_shape)
    return np.array([costmodels.reshard_time(tuple(val.shape), val.element_size(), s.output, whole, profile)
                     if s.output is not None else 0.0 for s in ns.strategies])


def step_activation_bytes(graph: StrategyGraph, choice: dict[fx.Node, int]) -> float:
    """Bytes per device of the largest set of a step's values alive at once, on local shapes
    as ``choice`` lays them out: each op's outputs live from where they are made to their
    last reader (views and in-place writes hold their input's storage); while an op runs, the
    copies of its inputs moved to where it reads them (a gathered shard) live too; the
    step's outputs are gathered whole at its end. Placeholders (the weights and cache) are
    state, not counted here."""
    mesh = graph.mesh_shape
    order = [n for n in graph.captured.graph.nodes if n.op == "call_function"]
    position = {n: i for i, n in enumerate(order)}
    last = {n: max((position.get(u, len(order)) for u in n.users), default=position[n]) for n in order}

    def local(meta, spec) -> float:
        return float(math.prod(local_shape(meta.shape, spec, mesh)) * meta.dtype.itemsize)

    size, moved = {}, {}
    for node in order:
        ns = graph.nodes.get(node)
        if ns is None or ns.info is None or ns.follows is not None:
            size[node] = moved[node] = 0.0
            continue
        strategy = ns.strategies[choice[node]]
        # a view or an in-place write holds its input's storage
        size[node] = 0.0 if aliases_first(node)[0] else sum(map(local, ns.info.outputs, strategy.outputs))
        moved[node] = sum(local(TensorMeta.of(src.meta["val"]), need)
                          for src, need in zip(tensor_inputs(node), strategy.inputs)
                          if need is not None and src in graph.nodes and _placed(graph, src, choice) != need)
    alive, peak, ending = 0.0, 0.0, {}
    for i, node in enumerate(order):
        alive += size[node]
        peak = max(peak, alive + moved[node])
        ending.setdefault(last[node], []).append(node)
        alive -= sum(size[n] for n in ending.pop(i, ()))
    output = next(iter(graph.captured.nodes("output")))
    gathered = sum(float(v.meta["val"].numel() * v.meta["val"].element_size())
                   for v in pytree.tree_leaves(output.args[0]) if isinstance(v, fx.Node) and "val" in v.meta)
    return max(peak, alive + gathered)


def _placed(graph: StrategyGraph, node: fx.Node, choice: dict[fx.Node, int]):
    """Where ``node``'s value lies under ``choice`` (a getitem: its producer's output)."""
    ns = graph.nodes[node]
    if ns.follows is not None:
        producer, index = ns.follows
        return graph.nodes[producer].strategies[choice[producer]].outputs[index]
    return ns.strategies[choice[node]].outputs[0]
