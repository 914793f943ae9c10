"""Costing: a strategy graph and a ``HardwareProfile`` -> the solver's ``SolveProblem``.

Decision nodes are the strategy graph's nodes, in graph order, followed by one ZeRO
node per parameter. A ZeRO node's strategies are pairs (placement i, level z), z in
0..2; the parameter's placeholder follows it (``Follower``: placeholder takes i). ZeRO
1/2 shard the optimizer state (and the gradient) over the mesh axes on which the
placement is Replicate; ZeRO 3 is not a level here but a placement: a parameter
split over an axis on which its consumers need it whole is gathered in forward and
its gradient reduce-scattered in backward (``passes.codegen``), which the edge tables
price. Per strategy of an op node, on local shapes:

    time    = forward + backward compute (roofline ``compute_time``; backward = 2x
              forward for ops on a gradient path, Kaplan et al. 2020)
    memory  = bytes of the local outputs kept for backward (non-view ops on a
              gradient path; an over-estimate: every such output counts as saved)

Per ZeRO node (i, z): parameter + gradient + AdamW state bytes of the local shard
(``model_state_bytes``; level 1 priced as level 2, which is how the runtime runs it), the AdamW step on the local optimizer shard, and for z >= 1
the all-gather of updated parameters plus the reduce-scatter that replaces the
gradient all-reduce, minus that all-reduce (≈ 0 on a ring: ZeRO 1/2 are nearly free
in time, which is why they are chosen only where memory demands them).

Per edge (producer u, consumer v, input position p): forward resharding of u's
output placement to what v's strategy needs (``reshard_time``) plus, when u is on
a gradient path, the backward collectives of the gradient, which arrives in
``codegen.gradient_spec(needed, v's outputs)`` (``backward_reshard_plan``): this is
where the data-parallel all-reduce and the ZeRO-3 reduce-scatter of parameter
gradients are counted, exactly as codegen runs them.

A parameter split where its consumer needs it whole (ZeRO-3) is priced as FSDP runs
it: gathered in forward, the copy freed, gathered again in backward (that is what
makes ZeRO-3 save memory), so its edge pays the forward gather twice.

Identical repeated layers share one set of variables: ``ties`` groups the same
position of every layer whose op sequence and strategy tables are identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor import Replicate

import costmodels
from passes.saved import VIEWS, kept_for_backward
from costmodels.formulas import BYTES_PER_PARAM
from passes.codegen import gradient_spec
from passes.layers import find_layers
from passes.placements import Spec, local_shape
from passes.solve import Follower, SolveProblem
from passes.strategies import StrategyGraph, tensor_inputs
from passes.strategy import ShardingStrategy, TensorMeta

ZERO_LEVELS = (0, 1, 2)
BACKWARD_FACTOR = 2.0  # backward does twice the forward FLOPs (Kaplan et al. 2020)
MATMULS = {"aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
           "aten.matmul.default", "aten.baddbmm.default"}
ATTENTION = {"aten.scaled_dot_product_attention.default"}
# Ops whose output aliases their input (no compute, nothing new saved): passes.saved.VIEWS


@dataclass
class Costs:
    """The solver problem plus the pieces ``explain()`` and the Prediction need."""

    graph: StrategyGraph
    profile: costmodels.HardwareProfile
    problem: SolveProblem
    nodes: list[fx.Node]  # problem index -> graph node (ZeRO nodes: their parameter's placeholder)
    index: dict[fx.Node, int]  # graph node -> problem index
    zero_node: dict[fx.Node, int]  # parameter placeholder -> its ZeRO node's problem index
    compute: list[np.ndarray]  # per problem node: compute seconds (optimizer step included)
    state_memory: list[np.ndarray]  # per problem node: parameter+gradient+optimizer bytes
    activation_memory: list[np.ndarray]
    edge_inputs: list[tuple[fx.Node, fx.Node, int]]  # per problem edge: (producer, consumer, position)
    layer_of: dict[fx.Node, int] = field(default_factory=dict)  # node -> layer number, in graph order
    precision: str = "fp32"
    recompute: frozenset[int] = frozenset()  # layers recomputed in backward
    pricer: object = None  # the price caches, to rebuild cheaply (e.g. with recomputation)

    def assignment(self, choice: dict[fx.Node, int], zero: dict[fx.Node, int] | None = None) -> list[int]:
        """Problem assignment of a graph choice (ZeRO level 0 unless ``zero`` says otherwise)."""
        out = [0] * self.problem.num_nodes
        for node, i in self.index.items():
            out[i] = choice[node]
        for ph, zi in self.zero_node.items():
            level = (zero or {}).get(ph, 0)
            out[zi] = choice[ph] * len(ZERO_LEVELS) + ZERO_LEVELS.index(min(level, 2))
        return out

    def choice(self, assignment: Sequence[int]) -> tuple[dict[fx.Node, int], dict[fx.Node, int]]:
        """(graph choice, ZeRO level 0..2 per parameter placeholder) of a problem assignment."""
        choice = {node: int(assignment[i]) for node, i in self.index.items()}
        for ph, zi in self.zero_node.items():  # the ZeRO node leads its placeholder
            choice[ph] = int(assignment[zi]) // len(ZERO_LEVELS)
        zero = {ph: ZERO_LEVELS[int(assignment[zi]) % len(ZERO_LEVELS)] for ph, zi in self.zero_node.items()}
        return choice, zero


def precision_of(graph: StrategyGraph) -> str:
    """"mixed" (2+2+12 bytes per parameter) for 16-bit parameters, else "fp32" (4+4+8)."""
    params = [n.meta["val"] for n in graph.nodes if n.name in graph.captured.params]
    return "mixed" if params and params[0].dtype in (torch.bfloat16, torch.float16) else "fp32"


def requires_grad(graph: StrategyGraph) -> set[fx.Node]:
    """Nodes on a gradient path: float values computed from a trainable parameter."""
    params = graph.captured.params
    out: set[fx.Node] = set()
    for node in graph.captured.nodes():
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            continue
        if node.op == "placeholder":
            if node.name in params and val.requires_grad:
                out.add(node)
        elif node.op == "call_function" and not node.meta.get("autopar_no_grad"):
            if any(isinstance(a, fx.Node) and a in out for a in node.all_input_nodes):
                out.add(node)
    return out


def _nbytes(meta: TensorMeta, spec: Spec, mesh: Sequence[int]) -> float:
    return float(math.prod(local_shape(meta.shape, spec, mesh)) * meta.dtype.itemsize)


def _dtype(meta: TensorMeta) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(meta.dtype, "fp32")


class _Pricer:
    """Caches of per-strategy and per-edge prices: repeated layers repeat the same keys."""

    def __init__(self, graph: StrategyGraph, profile: costmodels.HardwareProfile):
        self.mesh = graph.mesh_shape
        self.profile = profile
        self.reshard: dict[tuple, float] = {}
        self.tables: dict[tuple, np.ndarray] = {}
        self.node: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.state: dict[tuple, list] = {}
        self.follow: dict[tuple, object] = {}

    def zero(self, meta: TensorMeta, ns, precision: str) -> list[tuple[float, float, float]]:
        key = (meta.shape, meta.dtype, id(ns.strategies), precision)
        if key not in self.state:
            self.state[key] = [zero_costs(meta, s.output, z, precision, self.profile)
                               for s in ns.strategies for z in ZERO_LEVELS]
        return self.state[key]

    def move(self, meta: TensorMeta, src: Spec, dst: Spec, grad: Spec | None) -> float:
        key = (meta.shape, meta.dtype, src, dst, grad)
        if key not in self.reshard:
            size = meta.dtype.itemsize
            t = 0.0 if src == dst else costmodels.reshard_time(meta.shape, size, src, dst, self.profile)
            if grad is not None:
                steps = costmodels.backward_reshard_plan(meta.shape, size, src, dst, self.mesh, grad)
                t += sum(costmodels.collective_time(s.collective, s.bytes, s.axis, self.profile) for s in steps)
            self.reshard[key] = t
        return self.reshard[key]

    def edge(self, meta: TensorMeta, src_ns, out: int, ns_v, position: int, grad: bool,
             regather: bool = False) -> np.ndarray:
        # strategy tuples are shared by identical calls (build_strategy_graph): key by identity
        key = (meta.shape, meta.dtype, id(src_ns.strategies), out, id(ns_v.strategies), position, grad, regather)
        if key not in self.tables:
            have = [s.outputs[out] for s in src_ns.strategies]
            table = np.zeros((len(have), len(ns_v.strategies)))
            for j, s in enumerate(ns_v.strategies):
                need = s.inputs[position]
                if need is None:
                    continue
                g = gradient_spec(need, s.outputs) if grad else None
                for i, src in enumerate(have):
                    table[i, j] = self.move(meta, src, need, g)
                    if regather and src != need:  # FSDP frees the gathered copy, gathers again in backward
                        table[i, j] += self.move(meta, src, need, None)
            self.tables[key] = table
        return self.tables[key]

    def op(self, ns, on_grad_path: bool) -> tuple[np.ndarray, np.ndarray]:
        key = (id(ns.strategies), on_grad_path)
        if key not in self.node:
            times, saved = zip(*(self._op_strategy(ns.info, s, on_grad_path) for s in ns.strategies))
            self.node[key] = (np.array(times), np.array(saved))
        return self.node[key]

    def _op_strategy(self, info, strategy: ShardingStrategy, on_grad_path: bool) -> tuple[float, float]:
        name = info.name
        ins = [local_shape(m.shape, s, self.mesh) for m, s in zip(info.inputs, strategy.inputs) if s is not None]
        in_metas = [m for m, s in zip(info.inputs, strategy.inputs) if s is not None]
        outs = [local_shape(m.shape, s, self.mesh) for m, s in zip(info.outputs, strategy.outputs)]
        if name in VIEWS or not info.outputs:
            return 0.0, 0.0
        moved = sum(math.prod(x) * m.dtype.itemsize for x, m in zip(ins, in_metas))
        moved += sum(math.prod(x) * m.dtype.itemsize for x, m in zip(outs, info.outputs))
        flops = 0.0
        if name in MATMULS and ins:
            flops = 2.0 * math.prod(outs[0]) * ins[0][-1]
        elif name in ATTENTION and len(ins) >= 2:
            flops = 4.0 * math.prod(ins[0]) * ins[1][-2]  # QK^T and PV: 2 * 2 * B H Sq Sk D
        t = costmodels.compute_time(flops, moved, _dtype(info.outputs[0]), self.profile, name)
        if not on_grad_path:
            return t, 0.0
        saved = sum(math.prod(x) * m.dtype.itemsize for x, m in zip(outs, info.outputs))
        return t * (1.0 + BACKWARD_FACTOR), float(saved)


def zero_costs(meta: TensorMeta, spec: Spec, level: int, precision: str,
               profile: costmodels.HardwareProfile) -> tuple[float, float, float]:
    """(compute seconds, communication seconds, bytes) of one parameter's state at a ZeRO level."""
    mesh = profile.mesh_shape
    numel = math.prod(local_shape(meta.shape, spec, mesh))
    replicated = [a for a, p in enumerate(spec) if isinstance(p, Replicate) and mesh[a] > 1]
    shards = math.prod(mesh[a] for a in replicated)
    if level and shards == 1:  # nothing to shard over: level 0's memory, and never chosen
        return math.inf, 0.0, costmodels.model_state_bytes(numel, 0, 1, precision)
    shards = shards if level else 1
    # level 1 runs as level 2 (passes/plan.py: gradients come back reduce-scattered)
    memory = costmodels.model_state_bytes(numel, 2 if level == 1 else level, shards, precision)
    optimizer = sum(costmodels.compute_time(op.flops, op.bytes, op.dtype, profile)
                    for op in costmodels.adamw_ops([math.ceil(numel / shards)], _dtype(meta)))
    comm = 0.0
    if level:
        size = numel * meta.dtype.itemsize
        for a in replicated:
            ring = sum(costmodels.collective_time(c, size, a, profile) for c in ("all_gather", "reduce_scatter"))
            comm += max(0.0, ring - costmodels.collective_time("all_reduce", size, a, profile))
    return optimizer, comm, memory


def state_breakdown(numel: float, level: int, shards: int, precision: str) -> dict[str, float]:
    """Parameter / gradient / optimizer bytes of ``numel`` parameters at a ZeRO level."""
    p, g, o = BYTES_PER_PARAM[precision]
    n = max(shards, 1)
    return {
        "parameters": numel * p / (n if level >= 3 else 1),
        "gradients": numel * g / (n if level >= 1 else 1),  # level 1 runs as level 2
        "optimizer": numel * o / (n if level >= 1 else 1),
    }


def build_costs(graph: StrategyGraph, profile: costmodels.HardwareProfile, *, memory_limit: float | None = None,
                tie_layers: bool = True, follow_operands: bool = True, recompute: bool | Iterable[int] = False,
                pricer: "_Pricer | None" = None) -> Costs:
    """The SolveProblem of ``graph`` on ``profile`` (see the module docstring).

    ``recompute``: the repeated layers (True: all; or their numbers) that keep only the
    activations that leave them and run their forward again in backward (activation
    checkpointing per layer).
    """
    if tuple(profile.mesh_shape) != graph.mesh_shape:
        raise ValueError(
            f"autopar: the hardware profile is for mesh {profile.mesh_shape}, the strategy graph for "
            f"{graph.mesh_shape}; build both for the same mesh shape"
        )
    pricer = pricer if pricer is not None and pricer.profile is profile else _Pricer(graph, profile)
    grad_nodes = requires_grad(graph)
    precision = precision_of(graph)
    params = graph.captured.params
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    compute, state, activation, comm = [], [], [], []
    kept = kept_for_backward(graph.captured.graph.nodes, grad_nodes)  # outputs some backward reads
    followers: list[Follower] = []
    for node in nodes:
        ns = graph.nodes[node]
        k = len(ns.strategies)
        zeros = np.zeros(k)
        if ns.follows is not None:
            followers.append(Follower(index[node], index[ns.follows[0]], tuple(range(k))))
            compute.append(zeros); activation.append(zeros); state.append(zeros); comm.append(zeros)
        elif node.op == "placeholder":
            meta = TensorMeta.of(node.meta["val"])
            held = np.array([_nbytes(meta, s.output, graph.mesh_shape) for s in ns.strategies])
            is_state = node.name in params or node.name in graph.captured.buffers
            state.append(held if is_state and node.name not in params else zeros)
            activation.append(zeros if is_state else held)
            compute.append(zeros); comm.append(zeros)
        else:
            t, saved = pricer.op(ns, node in grad_nodes)
            compute.append(t); state.append(zeros); comm.append(zeros)
            activation.append(saved if node in kept else zeros)
            leader = _follow_operand(graph, node, t, pricer.follow) if follow_operands else None
            if leader is not None:
                followers.append(Follower(index[node], index[leader[0]], leader[1]))
    zero_node: dict[fx.Node, int] = {}
    for node in nodes:
        if node.name not in params:
            continue
        ns = graph.nodes[node]
        meta = TensorMeta.of(node.meta["val"])
        priced = pricer.zero(meta, ns, precision)
        zero_node[node] = len(nodes) + len(zero_node)
        compute.append(np.array([c[0] for c in priced]))
        comm.append(np.array([c[1] for c in priced]))
        state.append(np.array([c[2] for c in priced]))
        activation.append(np.zeros(len(priced)))
        followers.append(Follower(index[node], zero_node[node], tuple(i for i in range(len(ns.strategies))
                                                                    for _ in ZERO_LEVELS)))
    edges, edge_inputs = [], []
    for node in nodes:
        ns = graph.nodes[node]
        if node.op == "placeholder" or ns.follows is not None:
            continue
        for position, src in enumerate(tensor_inputs(node)):
            if src not in graph.nodes:
                continue
            src_ns = graph.nodes[src]
            out = src_ns.follows[1] if src_ns.follows is not None else 0
            meta = TensorMeta.of(src.meta["val"])
            table = pricer.edge(meta, src_ns, out, ns, position, src in grad_nodes, regather=src.name in params)
            edges.append((index[src], index[node], table))
            edge_inputs.append((src, node, position))
    all_nodes = nodes + list(zero_node)
    layer_of, ties = find_layers(graph, index, zero_node)
    led = {f.node for f in followers}  # a follower is set by its leader: tie leaders only
    ties = [[v for v in group if v not in led] for group in ties] if tie_layers else []
    ties = [group for group in ties if len(group) > 1]
    recomputed = set(layer_of.values()) if recompute is True else set(recompute or ())
    if recomputed:
        for node in nodes:
            if layer_of.get(node) in recomputed and node.op != "placeholder" and node in grad_nodes:
                v = index[node]
                compute[v] = compute[v] * (2.0 + BACKWARD_FACTOR) / (1.0 + BACKWARD_FACTOR)
                if all(layer_of.get(u) == layer_of[node] for u in node.users):
                    activation[v] = np.zeros_like(activation[v])
    problem = SolveProblem(
        node_time=[c + m for c, m in zip(compute, comm)],
        node_memory=[s + a for s, a in zip(state, activation)],
        edges=edges, memory_limit=memory_limit, ties=ties, followers=followers,
        node_names=[n.name for n in nodes] + [f"zero[{n.name}]" for n in zero_node],
    )
    return Costs(graph, profile, problem, all_nodes, index, zero_node, compute, state, activation, edge_inputs,
                 layer_of, precision, frozenset(recomputed), pricer)


def _follow_operand(graph: StrategyGraph, node: fx.Node, time: np.ndarray, cache: dict):
    """(operand, index map) when a one-operand op can take its operand's placement as it is.

    A view or unary pointwise op then follows its operand (the cheapest strategy that
    reads the operand where it lies), which removes it from the search; ops that
    cannot read every placement of their operand in place stay free.
    """
    sources = tensor_inputs(node)
    if len(sources) != 1 or sources[0] not in graph.nodes:
        return None
    ns, src_ns = graph.nodes[node], graph.nodes[sources[0]]
    out = src_ns.follows[1] if src_ns.follows is not None else 0
    key = (id(ns.strategies), id(src_ns.strategies), out)
    if key not in cache:
        cache[key] = _follow_map(ns, src_ns, out, time)
    return None if cache[key] is None else (sources[0], cache[key])


def _follow_map(ns, src_ns, out: int, time: np.ndarray):
    best: dict = {}
    for j, s in enumerate(ns.strategies):
        need = s.inputs[0]
        if need is not None and (need not in best or time[j] < time[best[need]]):
            best[need] = j
    index_map = []
    for s in src_ns.strategies:
        j = best.get(s.outputs[out])
        if j is None:
            return None
        index_map.append(j)
    return tuple(index_map)
