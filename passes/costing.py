"""Costing: a strategy graph and a ``HardwareProfile`` -> the solver's ``SolveProblem``.

Decision nodes are the strategy graph's nodes, in graph order, followed by one ZeRO
node per parameter. A ZeRO node's strategies are pairs (placement i, level z), z in
0..2; the parameter's placeholder follows it (``Follower``: placeholder takes i). ZeRO
1/2 shard the optimizer state (and the gradient) over the mesh axes on which the
placement is Replicate; ZeRO 3 is not a level here but a placement: a parameter
split over an axis on which its consumers need it whole is gathered in forward and
its gradient reduce-scattered in backward (``autopar.passes.lowering.codegen``), which the edge tables
price. Per strategy of an op node, on local shapes:

    time    = forward + backward compute (roofline ``compute_time``); for ops on a
              gradient path, backward is the ops autograd runs for the op
              (``costmodels.backward_ops``: two matmuls for a matmul plus a bias
              gradient's sum, the attention backward kernel, a ``gelu_backward`` for a
              gelu, nothing for an add; 2x the forward for ops the table does not
              know, Kaplan et al. 2020), each at its own kind's measured rate; an op
              whose rule says its work (``autopar.passes.rules.registry.OpWork``: a
              grouped matmul, the experts op) is priced from those ops, and the
              collectives it runs inside itself are added (``Pricer.op_comm``); a
              matmul pipelined with its collective (``OpWork.pipelined``, async tensor
              parallelism) is its chunks' matmuls, and its critical path's rest is
              communication (``costmodels.pipelined``); infinite (no choice) where that is
              not shorter than its matmul and collective apart;
              ``Costs.forward`` keeps the forward alone (what recomputation repeats)
    memory  = bytes of the local outputs some backward keeps (``autopar.passes.saved``): an
              op's own output its backward keeps, on the op; an input a consumer's
              backward saves, on the consumer, in the placement its strategy reads it
              (a gathered copy where the value is moved for it), shared among the
              readers that save it, plus what the op makes from it and saves
              (attention's logsumexp, a boolean mask's converted copy); in a
              recomputed layer (activation checkpointing), its inputs whole (the
              checkpoint holds them), what leaves it as usual, and what stays inside
              divided by the number of recomputed layers: backward rebuilds one
              layer's activations at a time, so together they charge one layer's.
              A graph that ends before its loss (planned without ``loss_fn``) trains
              with the default loss all the same: its memory for each placement of the
              first output, measured on fake tensors (``autopar.passes.loss_memory``), is added
              to that output's node: what its backward keeps as activations, what exists
              only while it runs (gradients being made, a gathered copy) as temporary

Per ZeRO node (i, z): the parameter's state at level z on placement i
(``autopar.passes.state_costs``). Per edge (producer u, consumer v, input position p): the
reshard of u's output to what v's strategy reads, and its gradient's collectives
(``autopar.passes.edge_costs``); under a mixed-precision policy an edge from a parameter also
holds the working copy its consumer keeps where it reads the parameter as it lies, none
where it is gathered for it (ZeRO-3) (``SolveProblem.edge_memory``).

Identical repeated layers share one set of variables: ``ties`` groups the same
position of every layer whose op sequence and strategy tables are identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import fx

from autopar import costmodels
from autopar.passes.capture import Captured
from autopar.passes.saved import VIEWS, keep_bases, saved_roles, saved_values
from autopar.costmodels.precision import META_KEY, MixedPrecision
from autopar.costmodels.step import comm_time, dual_steps
from autopar.passes.edge_costs import (UNPACKED, EdgeInput, EdgePrice, EdgePricer, Shares, alike_consumers,
                                       copy_readers, dtype_kind, edge_tables, local_bytes, parameter_shares,
                                       working_copy_memory)
from autopar.passes.state_costs import zero_costs, zero_split_dim
from autopar.passes.layers import find_layers
from autopar.passes.loss_memory import LossMemory, loss_memory, output_node, output_spec
from autopar.passes.placements import local_shape
from autopar.passes.read_copies import ReadGroup, extra_copy_bytes, read_groups
from autopar.passes.rules.registry import OpWork, work_of
from autopar.passes.solve import Follower, SolveProblem
from autopar.passes.beside_compute import beside_tables, overlaps
from autopar.passes.strategy_graph import StrategyGraph, tensor_inputs
from autopar.passes.op_strategies import ShardingStrategy, TensorMeta

ZERO_LEVELS = (0, 1, 2)
# Ops are priced by ``costmodels.backward_ops``; ``Costs.forward`` holds each op's forward
# alone; ``BACKWARD_FACTOR`` (``costmodels.formulas``) is the uniform approximation.
MATMULS = {"aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
           "aten.matmul.default", "aten.baddbmm.default"}
ATTENTION = {"aten.scaled_dot_product_attention.default"}
# In-place writes of some positions of their first input (a static key-value cache's new
# keys): they move the values they write, not the whole destination
SCATTER_WRITES = {"aten.index_copy_.default", "aten.index_put_.default"}
LINEAR = "aten.linear.default"
# Ops whose output aliases their input (no compute, nothing new saved): autopar.passes.saved.VIEWS


@dataclass
class Costs:
    """The solver problem plus the pieces ``explain()`` and the Prediction need."""

    graph: StrategyGraph
    profile: costmodels.HardwareProfile
    problem: SolveProblem
    nodes: list[fx.Node]  # problem index -> graph node (ZeRO nodes: their parameter's placeholder)
    index: dict[fx.Node, int]  # graph node -> problem index
    zero_node: dict[fx.Node, int]  # parameter placeholder -> its ZeRO node's problem index
    compute: list[np.ndarray]  # per problem node: compute seconds, forward + backward (optimizer step included)
    state_memory: list[np.ndarray]  # per problem node: parameter+gradient+optimizer bytes
    activation_memory: list[np.ndarray]
    # per problem node: bytes alive only while backward runs (the default loss's gradients)
    temporary_memory: list[np.ndarray]
    edge_inputs: list[tuple[fx.Node, fx.Node, int]]  # per problem edge: (producer, consumer, position)
    layer_of: dict[fx.Node, int] = field(default_factory=dict)  # node -> layer number, in graph order
    precision: str | MixedPrecision = "fp32"
    recompute: frozenset[int] = frozenset()  # layers recomputed in backward
    pricer: object = None  # the price caches, to rebuild cheaply (e.g. with recomputation)
    # per problem node: the forward compute alone (what recomputing a layer runs again);
    # zeros for placeholders and ZeRO nodes (the optimizer step is not a forward)
    forward: list[np.ndarray] = field(default_factory=list)
    edge_prices: list[EdgeInput] = field(default_factory=list)  # per problem edge: what prices it
    # per graph node: the strategies priced (``build_costs``'s ``allowed``); None: all of them
    allowed: Mapping[fx.Node, np.ndarray] | None = None
    # values whose readers save them, each reader charged a share of one copy (``read_copies``)
    read_groups: tuple[ReadGroup, ...] = ()
    # what backward keeps (``autopar.passes.saved``): per consumer, the inputs it saves as it
    # reads them (position, value, bytes per byte with its share); and the values kept where made
    saved_reads: Mapping[fx.Node, tuple] = field(default_factory=dict)
    kept: frozenset[fx.Node] = frozenset()
    # per problem node inside a recomputed layer: the share of its activations charged (1/R of
    # R recomputed layers: together one layer's); backward rebuilds the whole of them
    rebuilt_share: Mapping[int, float] = field(default_factory=dict)

    def read_copy_bytes(self, choice: Mapping[fx.Node, int]) -> dict[int, float]:
        """Problem node -> activation bytes beyond its costs where ``choice`` reads a saved value
        in more than one placement (``autopar.passes.read_copies``)."""
        return extra_copy_bytes(self.graph, self.nodes, self.read_groups, choice)

    def edge_price(self, edge: int, assignment: Sequence[int]) -> EdgePrice:
        """Problem edge ``edge`` under ``assignment``, itemised; its ``seconds`` is the table's entry."""
        u, v, _ = self.problem.edges[edge]
        i, j = int(assignment[u]), int(assignment[v])
        price = self.pricer.price(self.edge_prices[edge], i, j)
        if self.runs == 1 or self.pricer.once_per_step(self.edge_prices[edge])[i, j]:
            return price
        return price.repeated(self.runs)

    @property
    def runs(self) -> int:
        """How many times a training step runs the captured program: the micro-batches it
        accumulates (``Captured.accumulate``); the times here are the step's, all of them."""
        return self.graph.captured.accumulate

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
        for ph, level in zero.items():  # a level 1/2 that cannot split the state runs as level 0
            spec = self.graph.nodes[ph].strategies[choice[ph]].output
            if level and zero_split_dim(tuple(ph.meta["val"].shape), spec, self.graph.mesh_shape) is None:
                zero[ph] = 0
        return choice, zero


def precision_of(graph: StrategyGraph) -> str | MixedPrecision:
    """"bf16" (2+2+4 bytes per parameter) for 16-bit parameters, else "fp32" (4+4+8): a model
    given in bf16 trains in pure bf16 (AdamW's moments in the parameters' dtype), as it runs;
    a graph captured under a mixed-precision policy: its ``MixedPrecision`` (on the parameters'
    placeholders, ``costmodels.precision.META_KEY``)."""
    policies = [n.meta[META_KEY] for n in graph.nodes if n.name in graph.captured.params and META_KEY in n.meta]
    if policies:
        return policies[0]
    params = [n.meta["val"] for n in graph.nodes if n.name in graph.captured.params]
    return "bf16" if params and params[0].dtype in (torch.bfloat16, torch.float16) else "fp32"


def requires_grad(graph: StrategyGraph, grad_inputs: Iterable[str] = ()) -> set[fx.Node]:
    """Nodes on a gradient path of ``graph``'s capture (``carrying_gradient``)."""
    return carrying_gradient(graph.captured, grad_inputs)


def carrying_gradient(captured: Captured, grad_inputs: Iterable[str] = ()) -> set[fx.Node]:
    """Nodes on a gradient path: float values computed from a trainable parameter, or from
    one of the placeholders named in ``grad_inputs`` (inputs that carry a gradient back,
    e.g. the model's outputs entering a loss program). A pipeline stage receives exactly these
    with ``requires_grad`` (torch's ``PipelineStage`` takes it from what the sender made)."""
    params, grad_inputs = captured.params, set(grad_inputs)
    out: set[fx.Node] = set()
    for node in captured.nodes():
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            continue
        if node.op == "placeholder":
            if (node.name in params and val.requires_grad) or node.name in grad_inputs:
                out.add(node)
        elif node.op == "call_function" and not node.meta.get("autopar_no_grad"):
            if any(isinstance(a, fx.Node) and a in out for a in node.all_input_nodes):
                out.add(node)
    return out


class Pricer(EdgePricer):
    """Caches of per-strategy prices (and, as an ``EdgePricer``, of edge prices): repeated
    layers repeat the same keys."""

    def __init__(self, graph: StrategyGraph, profile: costmodels.HardwareProfile,
                 precision: str | MixedPrecision | None = None):
        # under a policy a parameter's gradient is reduced in its reduce dtype (``precision_of``)
        super().__init__(graph.mesh_shape, profile,
                         precision.reduce_bytes if isinstance(precision, MixedPrecision) else None)
        self.node: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.state: dict[tuple, list] = {}
        self.follow: dict[tuple, object] = {}
        self.read: dict[tuple, np.ndarray] = {}
        # what depends on the graph alone (layers, gradient path, kept values): the same in
        # every rebuild (``recompute_to_fit`` builds one per recomputed-layer count)
        self.graph = graph
        self.structure: dict[tuple, object] = {}

    def once(self, key: tuple, make):
        """``make()``, worked out once per graph (``structure``)."""
        if key not in self.structure:
            self.structure[key] = make()
        return self.structure[key]

    def casts(self, node: fx.Node, ns) -> np.ndarray | None:
        """Seconds per placement of a parameter's casts under a mixed-precision policy (its
        placeholder's ``META_KEY``: ``MixedPrecision.cast_time`` of the elements it holds as
        placed); None without one."""
        mixed = node.meta.get(META_KEY)
        if mixed is None:
            return None
        shape = tuple(node.meta["val"].shape)
        key = ("casts", shape, id(ns.strategies), mixed)
        if key not in self.tables:
            self.tables[key] = np.array([mixed.cast_time(math.prod(local_shape(shape, s.output, self.mesh)),
                                                         self.profile) for s in ns.strategies])
        return self.tables[key]

    def node_copy(self, node: fx.Node, ns) -> np.ndarray:
        """Bytes per (placement, ZeRO level) of the working copy a parameter's ZeRO node holds
        under its policy where its readers cannot (``edge_costs.copy_readers``): as it lies."""
        shape = tuple(node.meta["val"].shape)
        key = ("node copy", shape, id(ns.strategies), node.meta[META_KEY])
        if key not in self.tables:
            self.tables[key] = np.array([node.meta[META_KEY].working_copy_bytes(
                math.prod(local_shape(shape, s.output, self.mesh))) for s in ns.strategies for _ in ZERO_LEVELS])
        return self.tables[key]

    def zero(self, meta: TensorMeta, ns, precision: str, shares: Shares, runs: int = 1) -> list[tuple[float, float, float]]:
        key = (meta.shape, meta.dtype, id(ns.strategies), precision, shares, runs)
        if key not in self.state:
            self.state[key] = [zero_costs(meta, s.output, z, precision, self.profile, shares, runs)
                               for s in ns.strategies for z in ZERO_LEVELS]
        return self.state[key]


    def op(self, ns, on_grad_path: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward + backward seconds, forward seconds, bytes saved) per strategy of an op."""
        key = (id(ns.strategies), on_grad_path)
        if key not in self.node:
            times, forward, saved = zip(*(self._op_strategy(ns.info, s, on_grad_path) for s in ns.strategies))
            self.node[key] = (np.array(times), np.array(forward), np.array(saved))
        return self.node[key]

    def op_comm(self, ns, on_grad_path: bool) -> np.ndarray:
        """Seconds per strategy of the collectives an op runs inside itself, forward and
        backward (its rule's or kernel's ``OpWork.collectives``, e.g. an experts op's dispatch;
        of a pipelined one, what its critical path adds to its matmuls); zeros for ops without."""
        key = ("op comm", id(ns.strategies), on_grad_path)  # cached for every op: it runs on each op of each build
        if key not in self.node:
            works = [work_of(ns.info.op, s.kernel) for s in ns.strategies]
            if not any(works):
                self.node[key] = np.zeros(len(ns.strategies))
            else:
                dtype = dtype_kind(ns.info.outputs[0])
                self.node[key] = np.array([
                    0.0 if w is None else self._comm(w(ns.info, s, self.mesh, dtype), on_grad_path)
                    for w, s in zip(works, ns.strategies)])
        return self.node[key]

    def _comm(self, work: OpWork, on_grad_path: bool) -> float:
        if work.pipelined is not None:  # what its critical path adds to its matmuls; not offered where it does not pay
            t = costmodels.pipelined_times(work.pipelined, self.profile, on_grad_path)
            return t.forward + t.backward - t.compute_forward - t.compute_backward if t.pays else math.inf
        forward = comm_time(work.collectives, self.profile)
        return forward + comm_time(dual_steps(work.collectives), self.profile) if on_grad_path else forward

    def reads(self, ns, reads: tuple[tuple[int, fx.Node, float], ...]) -> np.ndarray | float:
        """Bytes per strategy of the inputs an op's backward saves as it reads them
        (``SavedValues.reads``: position, value, bytes per byte of it with its share)."""
        if not reads:
            return 0.0
        metas = tuple((i, TensorMeta.of(src.meta["val"]), per_byte) for i, src, per_byte in reads)
        key = (id(ns.strategies), tuple((i, m.shape, m.dtype, per_byte) for i, m, per_byte in metas))
        if key not in self.read:
            self.read[key] = np.array([
                sum(local_bytes(m, s.inputs[i], self.mesh) * per_byte for i, m, per_byte in metas
                    if i < len(s.inputs) and s.inputs[i] is not None)
                for s in ns.strategies])
        return self.read[key]

    def _op_strategy(self, info, strategy: ShardingStrategy, on_grad_path: bool) -> tuple[float, float, float]:
        name = info.name
        ins = [local_shape(m.shape, s, self.mesh) for m, s in zip(info.inputs, strategy.inputs) if s is not None]
        in_metas = [m for m, s in zip(info.inputs, strategy.inputs) if s is not None]
        outs = [local_shape(m.shape, s, self.mesh) for m, s in zip(info.outputs, strategy.outputs)]
        if name in VIEWS or not info.outputs:
            return 0.0, 0.0, 0.0
        out_bytes = float(sum(math.prod(x) * m.dtype.itemsize for x, m in zip(outs, info.outputs)))
        rule_work = work_of(info.op, strategy.kernel)
        if rule_work is not None:  # what its rule says it does; the collectives inside it are in ``op_comm``
            work = rule_work(info, strategy, self.mesh, dtype_kind(info.outputs[0]))
            if work.pipelined is not None:  # its matmuls alone; the critical path's rest in ``op_comm``
                t = costmodels.pipelined_times(work.pipelined, self.profile, on_grad_path)
                return t.compute_forward + t.compute_backward, t.compute_forward, out_bytes if on_grad_path else 0.0
            ops = work.ops
            t = sum(costmodels.compute_time(op.flops, op.bytes, op.dtype, self.profile, op.name, op.heads)
                    for op in ops)
            if not on_grad_path:
                return t, t, 0.0
            return t + costmodels.backward_time(ops, self.profile), t, out_bytes
        moved = sum(math.prod(x) * m.dtype.itemsize for x, m in zip(ins, in_metas)) + out_bytes
        if name in SCATTER_WRITES:  # reads what it writes and writes it in place: the destination is not streamed
            moved = 2.0 * sum(math.prod(x) * m.dtype.itemsize for x, m in zip(ins[1:], in_metas[1:]))
        flops = heads = 0.0
        if name in MATMULS and ins:
            flops = 2.0 * math.prod(outs[0]) * ins[0][-1]
        elif name in ATTENTION and len(ins) >= 2:
            heads = float(math.prod(ins[0][:-2]))  # B H, each head priced by its size
            flops = 4.0 * math.prod(ins[0]) * ins[1][-2]  # QK^T and PV: 2 * 2 * B H Sq Sk D
        dtype = dtype_kind(info.outputs[0])
        t = costmodels.compute_time(flops, moved, dtype, self.profile, name, heads)
        if not on_grad_path:
            return t, t, 0.0
        # a linear with a bias runs as addmm, whose backward adds the bias gradient's sum
        grad_name = "aten.addmm.default" if name == LINEAR and len(ins) > 2 else name
        op = costmodels.Op(flops, moved, dtype, grad_name, out_bytes, heads)
        return t + costmodels.backward_time([op], self.profile), t, out_bytes


def build_costs(graph: StrategyGraph, profile: costmodels.HardwareProfile, *, memory_limit: float | None = None,
                tie_layers: bool = True, follow_operands: bool = True, recompute: bool | Iterable[int] = False,
                pricer: "Pricer | None" = None, grad_inputs: Iterable[str] = (),
                allowed: Mapping[fx.Node, np.ndarray] | None = None) -> Costs:
    """The SolveProblem of ``graph`` on ``profile`` (see the module docstring).

    ``recompute``: the repeated layers (True: all; or their numbers) run under activation
    checkpointing: they keep their inputs and what leaves them, run their forward again in
    backward, and together hold one layer's activations while they do. ``grad_inputs``: placeholders, by name, that carry a
    gradient back (``requires_grad``). ``allowed``: a boolean mask per graph node of the strategies
    it may take (a manual layout's, ``autopar.passes.planner.intra_op.layout_costs``): edge tables
    and the default loss's memory are priced for those only, inf for the others (not a choice).
    """
    if tuple(profile.mesh_shape) != graph.mesh_shape:
        raise ValueError(
            f"autopar: the hardware profile is for mesh {profile.mesh_shape}, the strategy graph for "
            f"{graph.mesh_shape}; build both for the same mesh shape"
        )
    reuse = pricer is not None and pricer.profile is profile and pricer.graph is graph
    precision = precision_of(graph)
    pricer = pricer if reuse else Pricer(graph, profile, precision)
    grad_inputs = tuple(grad_inputs)
    # the capture alone decides the gradient path and what backward keeps: once for every mesh
    grad_nodes = graph.once(("grad", grad_inputs), lambda: requires_grad(graph, grad_inputs))
    params = graph.captured.params
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    # one ZeRO node per parameter, after the graph's nodes
    zero_node = {node: len(nodes) + k for k, node in enumerate(n for n in nodes if n.name in params)}
    layer_of, ties = pricer.once(("layers",), lambda: find_layers(graph, index, zero_node))
    recomputed = set(layer_of.values()) if recompute is True else set(recompute or ())
    # outputs some backward keeps where they are made, inputs saved as their consumers read
    # them, and what a checkpointed layer holds to run again: its inputs
    saved = graph.once(("saved", grad_inputs), lambda: saved_values(graph.captured.graph.nodes, grad_nodes))
    kept = keep_bases(graph.captured.graph.nodes, set(saved.held) | checkpoint_inputs(nodes, layer_of, recomputed))
    shares = pricer.once(("shares",), lambda: parameter_shares(graph))
    # under a policy: which reads of a parameter keep its working copy
    readers = pricer.once(("copy readers", grad_inputs), lambda: copy_readers(graph, grad_nodes))
    # what each node costs whatever is recomputed: priced once per graph, every rebuild gets copies
    priced = pricer.once(("node prices", grad_inputs, follow_operands), lambda: _node_prices(
        graph, nodes, index, zero_node, grad_nodes, saved, precision, shares, readers, pricer, follow_operands))
    compute, forward, state, comm = (list(part) for part in (priced.compute, priced.forward, priced.state,
                                                            priced.comm))
    read_memory, followers = dict(priced.read_memory), list(priced.followers)
    activation = list(priced.activation)
    for v, own in priced.own.items():  # an op's own output: kept where made unless its layer is recomputed
        activation[v] = (own if nodes[v] in kept else np.zeros(len(own))) + read_memory[v]
    # the edges do not depend on recomputation: priced once per graph, every rebuild gets copies
    masks = None if allowed is None else tuple(allowed[n].tobytes() for n in nodes)
    edges, edge_inputs, edge_prices = (list(part) for part in pricer.once(
        ("edges", grad_inputs, masks), lambda: edge_tables(graph, nodes, index, grad_nodes, shares, pricer.once(
            ("alike",), lambda: alike_consumers(graph, nodes, params)), pricer, allowed)))
    runs, once = graph.captured.accumulate, []
    if runs > 1:  # the step runs every micro-batch's program: its ops and moves, runs times
        once = [pricer.once_per_step(edge) for edge in edge_prices]
        compute, forward, comm = ([t * runs if v < len(nodes) else t for v, t in enumerate(part)]
                                  for part in (compute, forward, comm))
        edges = [(u, v, table * np.where(step, 1.0, runs)) for (u, v, table), step in zip(edges, once)]
    temporary = [np.zeros(len(a)) for a in activation]
    # the default loss of a graph planned without one (None: the graph holds its loss)
    loss = pricer.once(("loss",), lambda: loss_memory(graph.captured, graph.mesh_shape))
    if loss is not None:
        v = index[output_node(graph.captured)]
        _add_loss_memory(graph, v, loss, activation, temporary, read_memory.get(v, 0.0),
                         None if allowed is None else allowed[nodes[v]])
    all_nodes = nodes + list(zero_node)
    led = {f.node for f in followers}  # a follower is set by its leader: tie leaders only
    ties = [[v for v in group if v not in led] for group in ties] if tie_layers else []
    ties = [group for group in ties if len(group) > 1]
    scale: dict[int, float] = {}
    for node in nodes:
        if layer_of.get(node) in recomputed and node.op != "placeholder" and node in grad_nodes:
            v = index[node]
            compute[v] = compute[v] + forward[v]  # its forward runs again in backward
            if all(layer_of.get(u) == layer_of[node] for u in node.users):
                # Backward rebuilds one recomputed layer's activations at a time and frees them
                # before the next: the recomputed layers together hold one layer's worth (the
                # repeated layers are alike, so 1/R of each of R layers' sums to one layer's;
                # unlike layers are charged their mean). Its outputs, read outside, stay whole.
                scale[v] = 1.0 / len(recomputed)
                activation[v] = activation[v] * scale[v]
    problem = SolveProblem(
        node_time=[c + m for c, m in zip(compute, comm)],
        node_memory=[s + a + t for s, a, t in zip(state, activation, temporary)],
        edges=edges, memory_limit=memory_limit, ties=ties, followers=followers,
        node_names=[n.name for n in nodes] + [f"zero[{n.name}]" for n in zero_node],
        edge_memory=pricer.once(("copies", grad_inputs), lambda: working_copy_memory(
            edge_inputs, edge_prices, pricer, readers)),
    )
    problem.overlaps = overlaps(nodes, compute, forward, pricer.once(
        ("beside", grad_inputs, masks), lambda: beside_tables(edge_prices, pricer, allowed)), runs, once)
    groups = read_groups(saved.reads, index, read_memory, kept, scale)
    return Costs(graph, profile, problem, all_nodes, index, zero_node, compute, state, activation, temporary,
                 edge_inputs, layer_of, precision, frozenset(recomputed), pricer, forward, edge_prices, allowed,
                 groups, saved.reads, frozenset(kept), rebuilt_share=scale)


@dataclass(frozen=True)
class _NodePrices:
    """Per problem node, what ``build_costs`` prices whatever is recomputed (``_node_prices``)."""

    compute: tuple[np.ndarray, ...]
    forward: tuple[np.ndarray, ...]
    state: tuple[np.ndarray, ...]
    comm: tuple[np.ndarray, ...]
    # activation bytes; an op's depend on recomputation: there ``own`` (the output its backward
    # keeps where it is made) and ``read_memory`` (the inputs it saves as it reads them)
    activation: tuple[np.ndarray | None, ...]
    own: Mapping[int, np.ndarray]
    read_memory: Mapping[int, np.ndarray | float]
    followers: tuple[Follower, ...]


def _node_prices(graph: StrategyGraph, nodes: list[fx.Node], index: dict[fx.Node, int],
                 zero_node: dict[fx.Node, int], grad_nodes: set[fx.Node], saved, precision: str | MixedPrecision,
                 shares: dict[fx.Node, Shares], readers: dict[fx.Node, frozenset | None], pricer: Pricer,
                 follow_operands: bool) -> _NodePrices:
    """``build_costs``' prices of the graph's nodes, in order, then of one ZeRO node per parameter."""
    params = graph.captured.params
    compute, forward, state, activation, comm = [], [], [], [], []
    own_saved: dict[int, np.ndarray] = {}
    read_memory: dict[int, np.ndarray | float] = {}
    followers: list[Follower] = []
    for node in nodes:
        ns = graph.nodes[node]
        k = len(ns.strategies)
        zeros = np.zeros(k)
        if ns.follows is not None:
            followers.append(Follower(index[node], index[ns.follows[0]], tuple(range(k))))
            compute.append(zeros); forward.append(zeros); activation.append(zeros); state.append(zeros)
            comm.append(zeros)
        elif node.op == "placeholder":
            meta = TensorMeta.of(node.meta["val"])
            held = np.array([local_bytes(meta, s.output, graph.mesh_shape) for s in ns.strategies])
            is_state = node.name in params or node.name in graph.captured.buffers
            state.append(held if is_state and node.name not in params else zeros)
            activation.append(zeros if is_state else held)
            casts = pricer.casts(node, ns) if node.name in params else None  # under a policy
            compute.append(zeros if casts is None else casts); forward.append(zeros); comm.append(zeros)
        else:
            t, t_forward, own = pricer.op(ns, node in grad_nodes)
            compute.append(t); forward.append(t_forward); state.append(zeros)
            comm.append(pricer.op_comm(ns, node in grad_nodes))
            read_memory[index[node]] = pricer.reads(ns, saved.reads.get(node, ()))
            own_saved[index[node]] = own
            activation.append(None)
            leader = leader_of(graph, node, t, pricer, follow_operands)
            if leader is not None:
                followers.append(Follower(index[node], index[leader[0]], leader[1]))
    for node in nodes:
        if node.name not in params:
            continue
        ns = graph.nodes[node]
        meta = TensorMeta.of(node.meta["val"])
        priced = pricer.zero(meta, ns, precision, shares.get(node, UNPACKED), graph.captured.accumulate)
        compute.append(np.array([c[0] for c in priced]))
        forward.append(np.zeros(len(priced)))
        comm.append(np.array([c[1] for c in priced]))
        state.append(np.array([c[2] for c in priced]))
        activation.append(pricer.node_copy(node, ns) if node in readers and readers[node] is None
                          else np.zeros(len(priced)))
        followers.append(Follower(index[node], zero_node[node], tuple(i for i in range(len(ns.strategies))
                                                                    for _ in ZERO_LEVELS)))
    return _NodePrices(tuple(compute), tuple(forward), tuple(state), tuple(comm), tuple(activation), own_saved,
                       read_memory, tuple(followers))


def _add_loss_memory(graph: StrategyGraph, v: int, loss: LossMemory, activation: list, temporary: list,
                     reads: np.ndarray | float, allowed: np.ndarray | None = None) -> None:
    """The default loss's memory, by the placement of the first output (problem node ``v``).
    An output the graph keeps only because it returns it lives as long as the loss holds it,
    which the loss's memory counts: the graph's own count of it is dropped (not the inputs
    its op saves, ``reads``). ``allowed``: the placements priced (``build_costs``); the others are
    never taken (their edges are inf), their loss left out."""
    node = list(graph.nodes)[v]
    unpriced = {"activations": 0.0, "temporary": 0.0}
    priced = [loss.of(output_spec(graph, node, j)) if allowed is None or allowed[j] else unpriced
              for j in range(len(graph.nodes[node].strategies))]
    own = reads if _kept_only_as_output(node) else activation[v]
    activation[v] = own + np.array([p["activations"] for p in priced])
    temporary[v] = np.array([p["temporary"] for p in priced])


def _kept_only_as_output(node: fx.Node) -> bool:
    """No op of the graph reads ``node`` and its own backward does not keep it (a view keeps
    its base: not this case)."""
    if str(node.target) in VIEWS or any(user.op != "output" for user in node.users):
        return False
    roles = saved_roles(node, {})
    return roles is not None and not roles[1]


def checkpoint_inputs(nodes, layer_of: dict[fx.Node, int], recomputed: set[int]) -> set[fx.Node]:
    """Values made outside a recomputed layer and read inside it: the checkpoint holds them
    from forward until the layer's backward runs it again (``torch.utils.checkpoint`` keeps
    its inputs, whether or not an op's backward would). Parameters are state, not activations."""
    held: set[fx.Node] = set()
    for node in nodes:
        layer = layer_of.get(node)
        if layer not in recomputed or node.op == "placeholder":
            continue
        held.update(src for src in node.all_input_nodes
                    if layer_of.get(src) != layer and src.op == "call_function"
                    and isinstance(src.meta.get("val"), torch.Tensor))
    return held


def leader_of(graph: StrategyGraph, node: fx.Node, time: np.ndarray, pricer: Pricer, follow_operands: bool = True):
    """(leader, index map) of an op that follows another's strategy, else None: a view or
    unary op its operand (``follow_operand``), a reader on an in-place write's path the value
    it writes into (``StrategyGraph.in_place``)."""
    leader = follow_operand(graph, node, time, pricer.follow) if follow_operands else None
    if leader is None and graph.in_place:
        first = next(iter(tensor_inputs(node)), None)
        if (first, node) in graph.in_place:
            leader = (first, graph.in_place_choices(first, node, time))
    return leader


def follow_operand(graph: StrategyGraph, node: fx.Node, time: np.ndarray, cache: dict):
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
