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
              know, Kaplan et al. 2020), each at its own kind's measured rate;
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

Per ZeRO node (i, z): parameter + gradient + AdamW state bytes of the local shard as
the runtime holds them (``state_breakdown``: a bf16 model's AdamW state in bf16; level 2's
whole copy gathered for the step), the AdamW step on the local optimizer shard, and the
all-gather of updated parameters: at level 1 after the step (``autopar.runtime.zero1``: the
gradient is all-reduced whole, as at level 0, and the gathers are bucketed as the
gradients are), at level 2 in forward, where the reduce-scatter that replaces the
gradient all-reduce is also counted, minus that all-reduce (≈ 0 on a ring). Both
levels step the optimizer on 1/N of the state, which is what they buy in time.

Per edge (producer u, consumer v, input position p): forward resharding of u's
output placement to what v's strategy needs (``reshard_time``) plus, when u is on
a gradient path, the backward collectives of the gradient, which arrives in
``placements.gradient_spec(needed, v's outputs)`` (``backward_reshard_plan``): this is
where the data-parallel all-reduce and the ZeRO-3 reduce-scatter of parameter
gradients are counted, exactly as codegen runs them. An activation's collectives are
priced as a step meets them, right after compute (the profile's ``in_step`` fits); a
parameter's (bucketed gathers, reduce-scatters and gradient all-reduces) as timed
back to back. One function prices an edge (``_Pricer.price``): an ``EdgePrice``, its
``Charge`` items (each collective, each bucket's packing copies) and their total, which
is the table's entry; ``Costs.edge_price`` gives the items of a chosen edge, and
``explain()`` (``autopar.passes.planner.reasons``) reads them rather than pricing again.

A value moved to the same layout for several consumers is moved once (codegen shares
the move, and its gradient's collective, among them). Consumers that are alike (the
same strategy table at the same input position: q, k and v reading one normed
activation) nearly always take the same strategy, so each of k alike consumers' edges
pays 1/k of the move: exact where they agree, which the ties and the symmetric tables
make the rule.

A parameter's collectives (its gathers, its gradient's all-reduce or reduce-scatter)
travel packed in buckets, so each pays its bytes' part of one call's latency
(``Shares``, ``parameter_shares``), not a whole alpha: per-parameter latency would make
data parallelism of a model with many small tensors look far slower than it runs.

A parameter split where its consumer needs it whole (ZeRO-3) is priced as FSDP runs
it: gathered in forward, the copy freed, gathered again in backward (that is what
makes ZeRO-3 save memory), so its edge pays the forward gather twice. Each of a
parameter's gathers and reduce-scatters also pays the copies that pack it into and out
of its bucket's flat buffer (``costmodels.bucket_copy_bytes``), at the measured rate of
a copy.

Identical repeated layers share one set of variables: ``ties`` groups the same
position of every layer whose op sequence and strategy tables are identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

import numpy as np
import torch
from torch import fx
from torch.distributed.tensor import Replicate

from autopar import costmodels
from autopar.passes.saved import VIEWS, keep_bases, saved_roles, saved_values
from autopar.costmodels.formulas import BYTES_PER_PARAM
from autopar.costmodels.compute import dtype_name
from autopar.costmodels.precision import META_KEY, MixedPrecision, plain_zero_bytes
from autopar.passes.placements import gradient_spec
from autopar.passes.layers import find_layers
from autopar.passes.loss_memory import LossMemory, loss_memory, output_node, output_spec
from autopar.passes.placements import Spec, local_shape
from autopar.passes.rules.moe import GROUPED_MM_OPS, rows_share
from autopar.passes.solve import Follower, SolveProblem
from autopar.passes.strategy_graph import StrategyGraph, tensor_inputs
from autopar.passes.op_strategies import ShardingStrategy, TensorMeta

ZERO_LEVELS = (0, 1, 2)
# Ops are priced by ``costmodels.backward_ops``; ``Costs.forward`` holds each op's forward
# alone; ``BACKWARD_FACTOR`` (``costmodels.formulas``) is the uniform approximation.
MATMULS = {"aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
           "aten.matmul.default", "aten.baddbmm.default", *GROUPED_MM_OPS}
ATTENTION = {"aten.scaled_dot_product_attention.default"}
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

    def edge_price(self, edge: int, assignment: Sequence[int]) -> EdgePrice:
        """Problem edge ``edge`` under ``assignment``, itemised; its ``seconds`` is the table's entry."""
        u, v, _ = self.problem.edges[edge]
        return self.pricer.price(self.edge_prices[edge], int(assignment[u]), int(assignment[v]))

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
    """Nodes on a gradient path: float values computed from a trainable parameter, or from
    one of the placeholders named in ``grad_inputs`` (inputs that carry a gradient back,
    e.g. the model's outputs entering a loss program)."""
    params, grad_inputs = graph.captured.params, set(grad_inputs)
    out: set[fx.Node] = set()
    for node in graph.captured.nodes():
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


def _nbytes(meta: TensorMeta, spec: Spec, mesh: Sequence[int]) -> float:
    return float(math.prod(local_shape(meta.shape, spec, mesh)) * meta.dtype.itemsize)


def _dtype(meta: TensorMeta) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(meta.dtype, "fp32")


@dataclass(frozen=True)
class Shares:
    """The part of one call's latency a parameter's collectives pay: the runtime packs
    parameters into buckets, so a bucket pays alpha once. ``gather``: all-gathers and
    reduce-scatters, one call per segment of the graph (a layer, or a stretch between
    layers: ``autopar.passes.lowering.codegen.plan_buckets``); ``all_reduce``: gradient all-reduces in
    DDP-style buckets (``autopar.runtime.gradsync``). Activations travel alone (1, 1)."""

    gather: float = 1.0
    all_reduce: float = 1.0

    def of(self, collective: str) -> float:
        if collective in ("all_gather", "reduce_scatter"):
            return self.gather
        return self.all_reduce if collective == "all_reduce" else 1.0


UNPACKED = Shares()


class Charge(NamedTuple):
    """One priced item of a resharding edge: a collective on a mesh axis, or (``copies``)
    the copies that pack that collective's buffer into and out of its bucket."""

    collective: str
    axis: int
    seconds: float
    copies: bool = False


@dataclass(frozen=True)
class EdgePrice:
    """What moving one value to one consumer costs, itemised: ``seconds`` is the number the
    solver's edge table holds, and ``charges`` (collectives, then their bucket copies) are
    what it is made of, for ``explain()`` (``autopar.passes.planner.reasons``)."""

    charges: tuple[Charge, ...]
    seconds: float

    @staticmethod
    def of(charges: tuple[Charge, ...]) -> "EdgePrice":
        # collectives first, then the copies: the sum in the order the tables were always built
        return EdgePrice(charges, sum(c.seconds for c in charges if not c.copies)
                         + sum(c.seconds for c in charges if c.copies))

    def __add__(self, other: "EdgePrice") -> "EdgePrice":
        return EdgePrice(self.charges + other.charges, self.seconds + other.seconds)

    def shared(self, consumers: int) -> "EdgePrice":
        """The part one of ``consumers`` alike consumers pays of a move they share."""
        if consumers == 1:
            return self
        return EdgePrice(tuple(c._replace(seconds=c.seconds / consumers) for c in self.charges),
                         self.seconds / consumers)


NO_MOVE = EdgePrice((), 0.0)


@dataclass(frozen=True)
class EdgeInput:
    """What prices one problem edge (producer's value -> one consumer's input position):
    the arguments of ``_Pricer.price``, kept so that ``Costs.edge_price`` itemises exactly
    what the table holds."""

    meta: TensorMeta
    producer: object  # the producer's NodeStrategies
    output: int  # which of the producer's outputs the value is
    consumer: object  # the consumer's NodeStrategies
    position: int
    grad: bool  # the value is on a gradient path: its gradient's collectives count
    regather: bool = False  # a parameter: bucketed, and gathered again in backward (FSDP)
    shares: Shares = UNPACKED
    alike: int = 1  # consumers alike that share the move


def parameter_shares(graph: StrategyGraph, layer_of: dict[fx.Node, int]) -> dict[fx.Node, Shares]:
    """Each parameter's ``Shares``, from whole sizes (an upper bound on the calls: local
    shards fill buckets more slowly only where they are split)."""
    params = [n for n in graph.nodes if n.name in graph.captured.params]
    size = {n: float(n.meta["val"].numel() * n.meta["val"].element_size()) for n in params}
    total = sum(size.values())
    order = {n: i for i, n in enumerate(graph.captured.graph.nodes)}
    first_layered = min((order[n] for n in layer_of if n.op != "placeholder"), default=len(order))

    def segment(p: fx.Node):  # a layer, or the stretch before the layers, or after them
        if p in layer_of:
            return layer_of[p]
        first_use = min((order[u] for u in p.users), default=0)
        return "before" if first_use < first_layered else "after"

    per_segment: dict[object, float] = {}
    for p in params:
        per_segment[segment(p)] = per_segment.get(segment(p), 0.0) + size[p]
    buckets = costmodels.gradient_buckets(total)
    return {p: Shares(gather=size[p] / per_segment[segment(p)], all_reduce=min(1.0, buckets * size[p] / total))
            for p in params if size[p] > 0}


class _Pricer:
    """Caches of per-strategy and per-edge prices: repeated layers repeat the same keys."""

    def __init__(self, graph: StrategyGraph, profile: costmodels.HardwareProfile,
                 precision: str | MixedPrecision | None = None):
        self.mesh = graph.mesh_shape
        self.profile = profile
        # under a policy a parameter's gradient is reduced in its reduce dtype (``precision_of``)
        self.reduce_itemsize = precision.reduce_bytes if isinstance(precision, MixedPrecision) else None
        self.reshard: dict[tuple, float] = {}
        self.tables: dict[tuple, np.ndarray] = {}
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

    def zero(self, meta: TensorMeta, ns, precision: str, shares: Shares) -> list[tuple[float, float, float]]:
        key = (meta.shape, meta.dtype, id(ns.strategies), precision, shares)
        if key not in self.state:
            self.state[key] = [zero_costs(meta, s.output, z, precision, self.profile, shares)
                               for s in ns.strategies for z in ZERO_LEVELS]
        return self.state[key]

    def move(self, meta: TensorMeta, src: Spec, dst: Spec, grad: Spec | None, shares: Shares = UNPACKED,
             bucketed: bool = False) -> EdgePrice:
        """A value's forward reshard and its gradient's backward one, itemised; ``bucketed``
        (a parameter: ``autopar.passes.lowering.buckets`` gathers and reduce-scatters it packed in a flat
        buffer) adds the packing copies (``costmodels.bucket_copy_bytes``) at the measured
        copy rate."""
        key = (meta.shape, meta.dtype, src, dst, grad, shares, bucketed)
        if key not in self.reshard:
            size = meta.dtype.itemsize
            steps = () if src == dst else costmodels.reshard_plan(meta.shape, size, src, dst, self.mesh)
            if grad is not None:
                grad_size = self.reduce_itemsize if bucketed and self.reduce_itemsize else size
                steps += costmodels.backward_reshard_plan(meta.shape, grad_size, src, dst, self.mesh, grad)
            # an activation's move waits right after compute; a parameter's travels bucketed
            charges = tuple(Charge(s.collective, s.axis, costmodels.collective_time(
                s.collective, s.bytes, s.axis, self.profile, shares.of(s.collective), in_step=not bucketed))
                for s in steps)
            if bucketed:
                charges += tuple(
                    Charge(s.collective, s.axis, costmodels.compute_time(
                        0.0, copied, _dtype(meta), self.profile, "aten.copy_.default"), copies=True)
                    for s in steps if (copied := costmodels.bucket_copy_bytes(s.collective, s.bytes, self.mesh[s.axis])))
            self.reshard[key] = EdgePrice.of(charges)
        return self.reshard[key]

    def price(self, edge: EdgeInput, i: int, j: int) -> EdgePrice:
        """Moving the value from the producer's strategy ``i`` to what the consumer's strategy
        ``j`` needs (nothing where it reads no input there)."""
        strategy = edge.consumer.strategies[j]
        need = strategy.inputs[edge.position]
        if need is None:
            return NO_MOVE
        g = gradient_spec(need, strategy.outputs) if edge.grad else None
        return self._price(edge, edge.producer.strategies[i].outputs[edge.output], need, g)

    def _price(self, edge: EdgeInput, have: Spec, need: Spec, grad: Spec | None) -> EdgePrice:
        """The forward reshard ``have`` -> ``need``, the gradient's (arriving as ``grad``), and
        for a parameter gathered where its consumer needs it whole (FSDP frees the gathered
        copy) the gather again in backward; ``alike`` consumers share it."""
        price = self.move(edge.meta, have, need, grad, edge.shares, bucketed=edge.regather)
        if edge.regather and have != need:
            price = price + self.move(edge.meta, have, need, None, edge.shares, bucketed=True)
        return price.shared(edge.alike)

    def edge(self, edge: EdgeInput) -> np.ndarray:
        """The edge's table: ``price(edge, i, j).seconds`` for every pair of strategies."""
        # strategy tuples are shared by identical calls (build_strategy_graph): key by identity
        key = (edge.meta.shape, edge.meta.dtype, id(edge.producer.strategies), edge.output,
               id(edge.consumer.strategies), edge.position, edge.grad, edge.regather, edge.shares, edge.alike)
        if key not in self.tables:
            have = [s.outputs[edge.output] for s in edge.producer.strategies]
            table = np.zeros((len(have), len(edge.consumer.strategies)))
            for j, s in enumerate(edge.consumer.strategies):
                need = s.inputs[edge.position]
                if need is None:
                    continue
                g = gradient_spec(need, s.outputs) if edge.grad else None
                for i, src in enumerate(have):
                    table[i, j] = self._price(edge, src, need, g).seconds
            self.tables[key] = table
        return self.tables[key]

    def op(self, ns, on_grad_path: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward + backward seconds, forward seconds, bytes saved) per strategy of an op."""
        key = (id(ns.strategies), on_grad_path)
        if key not in self.node:
            times, forward, saved = zip(*(self._op_strategy(ns.info, s, on_grad_path) for s in ns.strategies))
            self.node[key] = (np.array(times), np.array(forward), np.array(saved))
        return self.node[key]

    def reads(self, ns, reads: tuple[tuple[int, fx.Node, float], ...]) -> np.ndarray | float:
        """Bytes per strategy of the inputs an op's backward saves as it reads them
        (``SavedValues.reads``: position, value, bytes per byte of it with its share)."""
        if not reads:
            return 0.0
        metas = tuple((i, TensorMeta.of(src.meta["val"]), per_byte) for i, src, per_byte in reads)
        key = (id(ns.strategies), tuple((i, m.shape, m.dtype, per_byte) for i, m, per_byte in metas))
        if key not in self.read:
            self.read[key] = np.array([
                sum(_nbytes(m, s.inputs[i], self.mesh) * per_byte for i, m, per_byte in metas
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
        moved = sum(math.prod(x) * m.dtype.itemsize for x, m in zip(ins, in_metas)) + out_bytes
        flops = heads = 0.0
        if name in MATMULS and ins:
            flops = 2.0 * math.prod(outs[0]) * ins[0][-1] * rows_share(info, strategy, self.mesh)
        elif name in ATTENTION and len(ins) >= 2:
            heads = float(math.prod(ins[0][:-2]))  # B H, each head priced by its size
            flops = 4.0 * math.prod(ins[0]) * ins[1][-2]  # QK^T and PV: 2 * 2 * B H Sq Sk D
        dtype = _dtype(info.outputs[0])
        t = costmodels.compute_time(flops, moved, dtype, self.profile, name, heads)
        if not on_grad_path:
            return t, t, 0.0
        # a linear with a bias runs as addmm, whose backward adds the bias gradient's sum
        grad_name = "aten.addmm.default" if name == LINEAR and len(ins) > 2 else name
        op = costmodels.Op(flops, moved, dtype, grad_name, out_bytes, heads)
        return t + costmodels.backward_time([op], self.profile), t, out_bytes


def zero_costs(meta: TensorMeta, spec: Spec, level: int, precision: str | MixedPrecision,
               profile: costmodels.HardwareProfile, shares: "Shares | None" = None) -> tuple[float, float, float]:
    """(compute seconds, communication seconds, bytes) of one parameter's state at a ZeRO level."""
    shares = shares or UNPACKED
    mesh = profile.mesh_shape
    numel = math.prod(local_shape(meta.shape, spec, mesh))
    replicated = [a for a, p in enumerate(spec) if isinstance(p, Replicate) and mesh[a] > 1]
    shards = math.prod(mesh[a] for a in replicated)
    if level and shards == 1:  # nothing to shard over: level 0's memory, and never chosen
        return math.inf, 0.0, sum(state_breakdown(numel, 0, 1, precision).values())
    shards = shards if level else 1
    memory = sum(state_breakdown(numel, level, shards, precision).values())
    mixed = isinstance(precision, MixedPrecision)  # AdamW steps the master; collectives' bytes by dtype
    master = dtype_name(precision.master) if mixed else _dtype(meta)
    optimizer = sum(costmodels.compute_time(op.flops, op.bytes, op.dtype, profile)
                    for op in costmodels.adamw_ops([math.ceil(numel / shards)], master))
    comm = 0.0
    size = precision.zero_bytes(numel) if mixed else plain_zero_bytes(numel, meta.dtype.itemsize)
    for a in replicated if level == 1 else ():  # after the step, in the gradients' buckets
        comm += costmodels.collective_time("all_gather", size["step_gather"], a, profile, shares.of("all_reduce"))
    for a in replicated if level == 2 else ():
        ring = sum(costmodels.collective_time(c, size[c], a, profile, shares.of(c))
                   for c in ("all_gather", "reduce_scatter"))
        comm += max(0.0, ring - costmodels.collective_time("all_reduce", size["all_reduce"], a, profile,
                                                           shares.of("all_reduce")))
    return optimizer, comm, memory


def state_breakdown(numel: float, level: int, shards: int, precision: str | MixedPrecision) -> dict[str, float]:
    """Bytes by kind of ``numel`` parameters at a ZeRO level, as the runtime holds them:
    level 1 splits the optimizer state; level 2 the gradients too, and stores the parameter
    split as well, gathering a whole copy once per step in forward that backward keeps
    (``autopar.passes.lowering.codegen`` storage; the dry run counts it with the activations).
    Under a mixed-precision policy: ``MixedPrecision.state_breakdown``."""
    if isinstance(precision, MixedPrecision):
        return precision.state_breakdown(numel, level, shards)
    p, g, o = BYTES_PER_PARAM[precision]
    n = max(shards, 1)
    return {
        "parameters": numel * p / (n if level >= 2 else 1),
        "gradients": numel * g / (n if level >= 2 else 1),
        "optimizer": numel * o / (n if level >= 1 else 1),
        "activations": numel * p if level == 2 and n > 1 else 0.0,
    }


def at_peak(held: dict[str, float]) -> dict[str, float]:
    """Bytes by kind at the peak of a step without a pipeline, from the most each kind
    holds (``held``: parameters, gradients, optimizer, activations, temporary). Two instants
    compete: backward's start, where every kept activation and the loss's backward
    temporaries are alive and no gradient is made yet; and the gradients' sum after
    backward, where the activations are freed and every gradient has a copy in its bucket
    (``autopar.runtime.gradsync`` packs them before the sums are written back). The solver's
    memory constraint adds every kind: an upper bound of both."""
    held = {"gradients": 0.0, "activations": 0.0, "temporary": 0.0, **held}
    start = {**held, "gradients": 0.0}
    summed = {**held, "activations": 0.0, "temporary": held.get("gradients", 0.0)}
    return start if sum(start.values()) >= sum(summed.values()) else summed


def build_costs(graph: StrategyGraph, profile: costmodels.HardwareProfile, *, memory_limit: float | None = None,
                tie_layers: bool = True, follow_operands: bool = True, recompute: bool | Iterable[int] = False,
                pricer: "_Pricer | None" = None, grad_inputs: Iterable[str] = ()) -> Costs:
    """The SolveProblem of ``graph`` on ``profile`` (see the module docstring).

    ``recompute``: the repeated layers (True: all; or their numbers) run under activation
    checkpointing: they keep their inputs and what leaves them, run their forward again in
    backward, and together hold one layer's activations while they do. ``grad_inputs``: placeholders, by name, that carry a
    gradient back (``requires_grad``).
    """
    if tuple(profile.mesh_shape) != graph.mesh_shape:
        raise ValueError(
            f"autopar: the hardware profile is for mesh {profile.mesh_shape}, the strategy graph for "
            f"{graph.mesh_shape}; build both for the same mesh shape"
        )
    reuse = pricer is not None and pricer.profile is profile and pricer.graph is graph
    precision = precision_of(graph)
    pricer = pricer if reuse else _Pricer(graph, profile, precision)
    grad_inputs = tuple(grad_inputs)
    grad_nodes = pricer.once(("grad", grad_inputs), lambda: requires_grad(graph, grad_inputs))
    params = graph.captured.params
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    compute, forward, state, activation, comm = [], [], [], [], []
    # one ZeRO node per parameter, after the graph's nodes
    zero_node = {node: len(nodes) + k for k, node in enumerate(n for n in nodes if n.name in params)}
    layer_of, ties = pricer.once(("layers",), lambda: find_layers(graph, index, zero_node))
    recomputed = set(layer_of.values()) if recompute is True else set(recompute or ())
    # outputs some backward keeps where they are made, inputs saved as their consumers read
    # them, and what a checkpointed layer holds to run again: its inputs
    saved = pricer.once(("saved", grad_inputs), lambda: saved_values(graph.captured.graph.nodes, grad_nodes))
    kept = keep_bases(graph.captured.graph.nodes, set(saved.held) | checkpoint_inputs(nodes, layer_of, recomputed))
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
            held = np.array([_nbytes(meta, s.output, graph.mesh_shape) for s in ns.strategies])
            is_state = node.name in params or node.name in graph.captured.buffers
            state.append(held if is_state and node.name not in params else zeros)
            activation.append(zeros if is_state else held)
            casts = pricer.casts(node, ns) if node.name in params else None  # under a policy
            compute.append(zeros if casts is None else casts); forward.append(zeros); comm.append(zeros)
        else:
            t, t_forward, own = pricer.op(ns, node in grad_nodes)
            compute.append(t); forward.append(t_forward); state.append(zeros); comm.append(zeros)
            read_memory[index[node]] = pricer.reads(ns, saved.reads.get(node, ()))
            activation.append((own if node in kept else zeros) + read_memory[index[node]])
            leader = _follow_operand(graph, node, t, pricer.follow) if follow_operands else None
            if leader is None and graph.in_place:  # on an in-place write's path a reader follows its value
                first = next(iter(tensor_inputs(node)), None)
                if (first, node) in graph.in_place:
                    leader = (first, graph.in_place_choices(first, node, t))
            if leader is not None:
                followers.append(Follower(index[node], index[leader[0]], leader[1]))
    shares = pricer.once(("shares",), lambda: parameter_shares(graph, layer_of))
    for node in nodes:
        if node.name not in params:
            continue
        ns = graph.nodes[node]
        meta = TensorMeta.of(node.meta["val"])
        priced = pricer.zero(meta, ns, precision, shares.get(node, UNPACKED))
        compute.append(np.array([c[0] for c in priced]))
        forward.append(np.zeros(len(priced)))
        comm.append(np.array([c[1] for c in priced]))
        state.append(np.array([c[2] for c in priced]))
        activation.append(np.zeros(len(priced)))
        followers.append(Follower(index[node], zero_node[node], tuple(i for i in range(len(ns.strategies))
                                                                    for _ in ZERO_LEVELS)))
    # the edges do not depend on recomputation: priced once per graph, every rebuild gets copies
    edges, edge_inputs, edge_prices = (list(part) for part in pricer.once(
        ("edges", grad_inputs), lambda: _edges(graph, nodes, index, grad_nodes, shares, pricer)))
    temporary = [np.zeros(len(a)) for a in activation]
    # the default loss of a graph planned without one (None: the graph holds its loss)
    loss = pricer.once(("loss",), lambda: loss_memory(graph.captured, graph.mesh_shape))
    if loss is not None:
        v = index[output_node(graph.captured)]
        _add_loss_memory(graph, v, loss, activation, temporary, read_memory.get(v, 0.0))
    all_nodes = nodes + list(zero_node)
    led = {f.node for f in followers}  # a follower is set by its leader: tie leaders only
    ties = [[v for v in group if v not in led] for group in ties] if tie_layers else []
    ties = [group for group in ties if len(group) > 1]
    for node in nodes:
        if layer_of.get(node) in recomputed and node.op != "placeholder" and node in grad_nodes:
            v = index[node]
            compute[v] = compute[v] + forward[v]  # its forward runs again in backward
            if all(layer_of.get(u) == layer_of[node] for u in node.users):
                # Backward rebuilds one recomputed layer's activations at a time and frees them
                # before the next: the recomputed layers together hold one layer's worth (the
                # repeated layers are alike, so 1/R of each of R layers' sums to one layer's;
                # unlike layers are charged their mean). Its outputs, read outside, stay whole.
                activation[v] = activation[v] / len(recomputed)
    problem = SolveProblem(
        node_time=[c + m for c, m in zip(compute, comm)],
        node_memory=[s + a + t for s, a, t in zip(state, activation, temporary)],
        edges=edges, memory_limit=memory_limit, ties=ties, followers=followers,
        node_names=[n.name for n in nodes] + [f"zero[{n.name}]" for n in zero_node],
    )
    return Costs(graph, profile, problem, all_nodes, index, zero_node, compute, state, activation, temporary,
                 edge_inputs, layer_of, precision, frozenset(recomputed), pricer, forward, edge_prices)


def _edges(graph: StrategyGraph, nodes: list[fx.Node], index: dict[fx.Node, int], grad_nodes: set[fx.Node],
           shares: dict[fx.Node, Shares], pricer: "_Pricer") -> tuple[list, list, list]:
    """(problem edges with their tables, (producer, consumer, position) of each, its ``EdgeInput``)."""
    edges, edge_inputs, edge_prices = [], [], []
    params = graph.captured.params
    alike = pricer.once(("alike",), lambda: _alike_consumers(graph, nodes, params))
    for node in nodes:
        ns = graph.nodes[node]
        if node.op == "placeholder" or ns.follows is not None:
            continue
        for position, src in enumerate(tensor_inputs(node)):
            if src not in graph.nodes:
                continue
            src_ns = graph.nodes[src]
            out = src_ns.follows[1] if src_ns.follows is not None else 0
            edge = EdgeInput(TensorMeta.of(src.meta["val"]), src_ns, out, ns, position, src in grad_nodes,
                             regather=src.name in params, shares=shares.get(src, UNPACKED),
                             alike=alike.get((src, node, position), 1))
            table = pricer.edge(edge)
            if position == 0 and (src, node) in graph.in_place:  # an in-place write's path: never moved
                table = table + graph.in_place_mask(src, node)
            edges.append((index[src], index[node], table))
            edge_inputs.append((src, node, position))
            edge_prices.append(edge)
    return edges, edge_inputs, edge_prices


def _add_loss_memory(graph: StrategyGraph, v: int, loss: LossMemory, activation: list, temporary: list,
                     reads: np.ndarray | float) -> None:
    """The default loss's memory, by the placement of the first output (problem node ``v``).
    An output the graph keeps only because it returns it lives as long as the loss holds it,
    which the loss's memory counts: the graph's own count of it is dropped (not the inputs
    its op saves, ``reads``)."""
    node = list(graph.nodes)[v]
    priced = [loss.of(output_spec(graph, node, j)) for j in range(len(graph.nodes[node].strategies))]
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


def _alike_consumers(graph: StrategyGraph, nodes, params) -> dict[tuple[fx.Node, fx.Node, int], int]:
    """(producer, consumer, position) -> how many consumers of the producer's value are alike
    (same strategy table, same input position), where more than one: they share one move.
    Parameters are left out: their moves are bucketed (``Shares``)."""
    groups: dict[tuple, list] = {}
    for node in nodes:
        ns = graph.nodes[node]
        if node.op == "placeholder" or ns.follows is not None:
            continue
        for position, src in enumerate(tensor_inputs(node)):
            if src in graph.nodes and src.name not in params:
                groups.setdefault((src, id(ns.strategies), position), []).append((src, node, position))
    return {edge: len(group) for group in groups.values() if len(group) > 1 for edge in group}


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
