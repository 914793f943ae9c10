"""Edge tables: what moving a value from its producer's placement to what its consumer's
strategy reads costs (``autopar.passes.costing`` puts them on the solver's edges).

Per edge (producer u, consumer v, input position p): forward resharding of u's
output placement to what v's strategy needs (``reshard_time``) plus, when u is on
a gradient path, the backward collectives of the gradient, which arrives in
``placements.gradient_spec(needed, v's outputs)`` (``backward_reshard_plan``): this is
where the data-parallel all-reduce and the ZeRO-3 reduce-scatter of parameter
gradients are counted, exactly as codegen runs them. An activation's collectives are
priced as a step meets them, right after compute (the profile's ``in_step`` fits); a
parameter's (bucketed gathers, reduce-scatters and gradient all-reduces) as timed
back to back. One function prices an edge (``Pricer.price``): an ``EdgePrice``, its
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

Under a mixed-precision policy an edge from a parameter also holds memory
(``SolveProblem.edge_memory``): the working copy in the compute dtype
(``MixedPrecision.working_copy_bytes``) that the consumer's backward keeps where it reads the
parameter where it lies (ZeRO-0/1/2, tensor parallel) and saves it (``saved.saved_roles``: a
linear saves its weight, not its bias; an embedding saves no weight); none where the
parameter is moved for it (ZeRO-3: gathered, used and freed) or not saved. The runtime casts
once for all of a parameter's readers, so each of its k saving reads holds 1/k (exact where
they read it alike). A parameter read by a view that follows it, or by the graph's output,
keeps its copy whatever its consumers read: its ZeRO node holds it (``copy_readers`` None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch import fx

from autopar import costmodels
from autopar.costmodels.precision import META_KEY, MixedPrecision
from autopar.passes.layers import first_segments_of
from autopar.passes.op_strategies import TensorMeta
from autopar.passes.placements import Spec, gradient_spec, local_shape
from autopar.passes.saved import saved_roles
from autopar.passes.strategy_graph import StrategyGraph, tensor_inputs


def local_bytes(meta: TensorMeta, spec: Spec, mesh: Sequence[int]) -> float:
    return float(math.prod(local_shape(meta.shape, spec, mesh)) * meta.dtype.itemsize)


def dtype_kind(meta: TensorMeta) -> str:
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
    # the part of its collectives no compute is left to hide (``costmodels.overlap``): its
    # share of the last gradient bucket, and of the first segment's gather
    all_reduce_tail: float = 0.0
    gather_tail: float = 0.0

    def of(self, collective: str) -> float:
        if collective in ("all_gather", "reduce_scatter"):
            return self.gather
        return self.all_reduce if collective == "all_reduce" else 1.0

    def tail(self, collective: str) -> float:
        return self.all_reduce_tail if collective == "all_reduce" else self.gather_tail


UNPACKED = Shares()


class Charge(NamedTuple):
    """One priced item of a resharding edge: a collective on a mesh axis, or (``copies``)
    the copies that pack that collective's buffer into and out of its bucket. A collective
    the runtime runs beside compute (``costmodels.overlap``) runs ``busy`` seconds beside its
    ``window``'s compute and hides ``hidden`` of its ``seconds`` there."""

    collective: str
    axis: int
    seconds: float
    copies: bool = False
    window: str = ""
    busy: float = 0.0
    hidden: float = 0.0


@dataclass(frozen=True)
class EdgePrice:
    """What moving one value to one consumer costs, itemised: ``seconds`` is the number the
    solver's edge table holds (what the step waits for: hidden time left out), and ``charges``
    (collectives, then their bucket copies) are what it is made of, for ``explain()``
    (``autopar.passes.planner.reasons``)."""

    charges: tuple[Charge, ...]
    seconds: float

    @staticmethod
    def of(charges: tuple[Charge, ...]) -> "EdgePrice":
        # collectives first, then the copies: the sum in the order the tables were always built
        return EdgePrice(charges, sum(c.seconds - c.hidden for c in charges if not c.copies)
                         + sum(c.seconds for c in charges if c.copies))

    def beside(self, window: str) -> tuple[float, float]:
        """(seconds run beside ``window``'s compute, seconds hidden there)."""
        return (sum(c.busy for c in self.charges if c.window == window),
                sum(c.hidden for c in self.charges if c.window == window))

    def __add__(self, other: "EdgePrice") -> "EdgePrice":
        return EdgePrice(self.charges + other.charges, self.seconds + other.seconds)

    def repeated(self, runs: int) -> "EdgePrice":
        """The move made ``runs`` times in a step (once per accumulated micro-batch)."""
        if runs == 1:
            return self
        return EdgePrice(tuple(c._replace(seconds=c.seconds * runs, busy=c.busy * runs, hidden=c.hidden * runs)
                               for c in self.charges), self.seconds * runs)

    def shared(self, consumers: int) -> "EdgePrice":
        """The part one of ``consumers`` alike consumers pays of a move they share."""
        if consumers == 1:
            return self
        return EdgePrice(tuple(c._replace(seconds=c.seconds / consumers, busy=c.busy / consumers,
                                          hidden=c.hidden / consumers) for c in self.charges),
                         self.seconds / consumers)


NO_MOVE = EdgePrice((), 0.0)


@dataclass(frozen=True)
class EdgeInput:
    """What prices one problem edge (producer's value -> one consumer's input position):
    the arguments of ``Pricer.price``, kept so that ``Costs.edge_price`` itemises exactly
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


def parameter_shares(graph: StrategyGraph) -> dict[fx.Node, Shares]:
    """Each parameter's ``Shares``, from whole sizes (an upper bound on the calls: local
    shards fill buckets more slowly only where they are split), gathered with the others of
    its first reader's segment (a repeated layer, or a stretch between layers) as codegen
    buckets them."""
    captured = graph.captured
    params = [n for n in graph.nodes if n.name in captured.params]
    size = {n: float(n.meta["val"].numel() * n.meta["val"].element_size()) for n in params}
    total = sum(size.values())
    segment = first_segments_of(graph)
    per_segment: dict[int | None, float] = {}
    for p in params:
        per_segment[segment.get(p)] = per_segment.get(segment.get(p), 0.0) + size[p]
    buckets = costmodels.gradient_buckets(total)
    # the last gradient bucket, and the first segment's gather, have no compute left to hide
    # behind: each parameter pays its share of them
    return {p: Shares(gather=size[p] / per_segment[segment.get(p)], all_reduce=min(1.0, buckets * size[p] / total),
                      all_reduce_tail=1.0 / buckets, gather_tail=1.0 / len(per_segment))
            for p in params if size[p] > 0}


class EdgePricer:
    """Caches of edge prices, by shapes and strategy tables: repeated layers repeat the same keys."""

    def __init__(self, mesh: Sequence[int], profile: costmodels.HardwareProfile, reduce_itemsize: int | None = None):
        self.mesh = tuple(mesh)
        self.profile = profile
        # under a mixed-precision policy a parameter's gradient is reduced in its reduce dtype
        self.reduce_itemsize = reduce_itemsize
        self.reshard: dict[tuple, EdgePrice] = {}
        self.tables: dict[tuple, np.ndarray] = {}
        # a number per distinct placement made or read, so a pair's price is looked up by
        # numbers: hashing torch's placements was most of a cached price's cost
        self.numbers: dict = {}
        self.pairs: dict[tuple, EdgePrice] = {}  # by shape, numbered pair, shares, regather
        self.sides: dict[tuple, bool] = {}  # per edge table: whether one end's strategy alone sets it

    def move(self, meta: TensorMeta, src: Spec, dst: Spec, grad: Spec | None, shares: Shares = UNPACKED,
             bucketed: bool = False, regather: bool = False) -> EdgePrice:
        """A value's forward reshard and its gradient's backward one, itemised; ``bucketed``
        (a parameter: ``autopar.passes.lowering.buckets`` gathers and reduce-scatters it packed in a flat
        buffer) adds the packing copies (``costmodels.bucket_copy_bytes``) at the measured
        copy rate, and runs what the runtime overlaps beside compute (``_charge``);
        ``regather``: the forward reshard is ZeRO-3's gather again in backward."""
        key = (meta.shape, meta.dtype, src, dst, grad, shares, bucketed, regather)
        if key not in self.reshard:
            size = meta.dtype.itemsize
            steps = () if src == dst else costmodels.reshard_plan(meta.shape, size, src, dst, self.mesh)
            forward = len(steps)
            if grad is not None:
                grad_size = self.reduce_itemsize if bucketed and self.reduce_itemsize else size
                steps += costmodels.backward_reshard_plan(meta.shape, grad_size, src, dst, self.mesh, grad)
            summed = any(s.collective == "all_reduce" for s in steps[forward:])  # HSDP: reduced on the spot
            charges = tuple(self._charge(s, shares, bucketed, costmodels.kind_of(s.collective, i >= forward, regather,
                                                                                 summed))
                            for i, s in enumerate(steps))
            if bucketed:
                charges += tuple(
                    Charge(s.collective, s.axis, costmodels.compute_time(
                        0.0, copied, dtype_kind(meta), self.profile, "aten.copy_.default"), copies=True)
                    for s in steps if (copied := costmodels.bucket_copy_bytes(s.collective, s.bytes, self.mesh[s.axis])))
            self.reshard[key] = EdgePrice.of(charges)
        return self.reshard[key]

    def _charge(self, s, shares: Shares, bucketed: bool, kind: str | None) -> Charge:
        """One collective: an activation's waits right after compute; a parameter's travels
        bucketed, and where the runtime runs it beside compute (``kind``), all but its tail
        runs there and hides the profile's share of that (``costmodels.overlap``)."""
        seconds = costmodels.collective_time(s.collective, s.bytes, s.axis, self.profile, shares.of(s.collective),
                                             in_step=not bucketed)
        share = costmodels.hidden_share(self.profile.overlap, kind) if bucketed else 0.0
        if share == 0.0:
            return Charge(s.collective, s.axis, seconds)
        busy = seconds * (1.0 - shares.tail(s.collective))
        return Charge(s.collective, s.axis, seconds, window=costmodels.WINDOW[kind], busy=busy, hidden=share * busy)

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
        return self._moved(edge, have, need, grad).shared(edge.alike)

    def _moved(self, edge: EdgeInput, have: Spec, need: Spec, grad: Spec | None) -> EdgePrice:
        """``_price`` before ``alike`` consumers share it."""
        price = self.move(edge.meta, have, need, grad, edge.shares, bucketed=edge.regather)
        if edge.regather and have != need:
            price = price + self.move(edge.meta, have, need, None, edge.shares, bucketed=True, regather=True)
        return price

    def once_per_step(self, edge: EdgeInput) -> np.ndarray:
        """Per pair of strategies, whether the edge moves nothing in a micro-batch's program, so
        that a step accumulating several runs its collectives once: a parameter read as it is
        stored, whose gradient's sum is the step's gradient sync (``autopar.runtime.gradsync``,
        after the last micro-batch's backward). Every other move runs in each micro-batch: an
        activation's reshard, a parameter gathered for its reader (ZeRO-3) and its gradient's
        reduce-scatter, which that gather's backward runs (``autopar.passes.lowering.buckets``)."""
        key = ("once per step", id(edge.producer.strategies), edge.output, id(edge.consumer.strategies),
               edge.position, edge.regather)
        if key not in self.tables:
            held, have, _ = self._distinct(("made", id(edge.producer.strategies), edge.output),
                                           lambda: [s.outputs[edge.output] for s in edge.producer.strategies])
            read, reads, _ = self._distinct(("read", id(edge.consumer.strategies), edge.position, edge.grad),
                                            lambda: [_read(s, edge.position, edge.grad)
                                                     for s in edge.consumer.strategies])
            same = np.array([[edge.regather and (need is None or need == h) for need, _ in reads] for h in have],
                            dtype=bool).reshape(len(have), len(reads))
            self.tables[key] = same[np.ix_(held, read)]
        return self.tables[key]

    def working_copy(self, edge: EdgeInput, mixed: MixedPrecision, readers: int) -> np.ndarray:
        """Bytes per pair of strategies of a parameter's working copy that this reading edge
        holds (the module docstring): its ``readers``' share of the copy where the consumer
        reads the parameter as it lies, 0 where it is moved or not read."""
        key = ("copy", edge.meta.shape, id(edge.producer.strategies), edge.output, id(edge.consumer.strategies),
               edge.position, mixed, readers)
        if key not in self.tables:
            have = [s.outputs[edge.output] for s in edge.producer.strategies]
            copy = [mixed.working_copy_bytes(math.prod(local_shape(edge.meta.shape, h, self.mesh))) / readers
                    for h in have]
            self.tables[key] = np.array([[c if s.inputs[edge.position] == h else 0.0
                                          for s in edge.consumer.strategies] for h, c in zip(have, copy)])
        return self.tables[key]

    def edge(self, edge: EdgeInput, rows: np.ndarray | None = None, cols: np.ndarray | None = None) -> np.ndarray:
        """The edge's table: ``price(edge, i, j).seconds`` for every pair of strategies, or,
        given ``rows`` and ``cols`` (boolean masks of the producer's and the consumer's
        strategies that may be taken), for those pairs only, inf for the others (no choice). A
        table that depends on one end alone is priced whole all the same (a few moves): so it
        stays separable, and the solver's shrinking folds it as it folds the whole table."""
        return self._table(edge, rows, cols, "seconds", lambda price: price.seconds)

    def beside(self, edge: EdgeInput, window: str, rows: np.ndarray | None = None,
               cols: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The edge's tables of seconds run beside ``window``'s compute, and hidden there
        (``EdgePrice.beside``), shaped and masked as ``edge``'s."""
        return tuple(self._table(edge, rows, cols, (window, part), lambda price: price.beside(window)[part])
                     for part in (0, 1))

    def _table(self, edge: EdgeInput, rows: np.ndarray | None, cols: np.ndarray | None, what,
               value) -> np.ndarray:
        """``value(price(edge, i, j))`` for every pair of strategies (``edge``'s masks)."""
        # strategy tuples are shared by identical calls (build_strategy_graph): key by identity
        whole = (edge.meta.shape, edge.meta.dtype, id(edge.producer.strategies), edge.output,
                 id(edge.consumer.strategies), edge.position, edge.grad, edge.regather, edge.shares, edge.alike)
        if rows is not None and self._one_sided(whole, edge):
            rows = cols = None
        key = (what, *whole, None if rows is None else rows.tobytes(), None if cols is None else cols.tobytes())
        if key not in self.tables:
            # price each distinct (placement held, placement read) pair once: many strategies
            # of a node make or read a value alike
            held, have, have_numbers = self._distinct(
                ("made", id(edge.producer.strategies), edge.output),
                lambda: [s.outputs[edge.output] for s in edge.producer.strategies])
            read, reads, read_numbers = self._distinct(
                ("read", id(edge.consumer.strategies), edge.position, edge.grad),
                lambda: [_read(s, edge.position, edge.grad) for s in edge.consumer.strategies])
            moved = (edge.meta.shape, edge.meta.dtype, edge.shares, edge.regather)
            priced = np.zeros((len(have), len(reads)))
            for a in np.unique(held if rows is None else held[rows]):
                for b in np.unique(read if cols is None else read[cols]):
                    need, g = reads[b]
                    if need is None:
                        continue
                    pair = (*moved, have_numbers[a], read_numbers[b])
                    if pair not in self.pairs:
                        self.pairs[pair] = self._moved(edge, have[a], need, g)
                    priced[a, b] = value(self.pairs[pair].shared(edge.alike))
            table = priced[np.ix_(held, read)]
            if rows is not None:
                table[~rows, :] = np.inf
            if cols is not None:
                table[:, ~cols] = np.inf
            self.tables[key] = table
        return self.tables[key]

    def _distinct(self, key: tuple, values) -> tuple[np.ndarray, list, list[int]]:
        """(per strategy, the index of its value among the distinct ones; the distinct values;
        their numbers, ``self.numbers``) of a strategy table, ``values()`` giving one per
        strategy; worked out once per table."""
        if key not in self.tables:
            index: dict = {}
            of = np.array([index.setdefault(v, len(index)) for v in values()], dtype=np.int64)
            self.tables[key] = (of, list(index), [self.numbers.setdefault(v, len(self.numbers)) for v in index])
        return self.tables[key]

    def _one_sided(self, key: tuple, edge: EdgeInput) -> bool:
        """Whether the edge's table is a function of one end's strategy: every producer strategy
        gives the value one placement, or every consumer strategy reads it (and sends its
        gradient back) one way."""
        if key not in self.sides:
            have = {s.outputs[edge.output] for s in edge.producer.strategies}
            reads = {(s.inputs[edge.position], gradient_spec(s.inputs[edge.position], s.outputs)
                      if edge.grad and s.inputs[edge.position] is not None else None)
                     for s in edge.consumer.strategies}
            self.sides[key] = len(have) == 1 or len(reads) == 1
        return self.sides[key]


def _read(strategy, position: int, grad: bool) -> tuple[Spec | None, Spec | None]:
    """How ``strategy`` reads its input ``position`` and (``grad``) sends its gradient back."""
    need = strategy.inputs[position]
    return need, gradient_spec(need, strategy.outputs) if grad and need is not None else None


def edge_tables(graph: StrategyGraph, nodes: list[fx.Node], index: dict[fx.Node, int], grad_nodes: set[fx.Node],
                shares: dict[fx.Node, Shares], alike: dict, pricer: EdgePricer,
                allowed: Mapping[fx.Node, np.ndarray] | None = None,
                training: bool = True) -> tuple[list, list, list]:
    """(problem edges with their tables, (producer, consumer, position) of each, its ``EdgeInput``);
    ``allowed``: the strategies each node may take (``EdgePricer.edge``'s masks), None: all.
    ``training`` False (serving): a parameter moved for its consumer is moved once per step,
    like any value (no backward to gather it again for)."""
    edges, edge_inputs, edge_prices = [], [], []
    params = graph.captured.params
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
                             regather=training and src.name in params, shares=shares.get(src, UNPACKED),
                             alike=alike.get((src, node, position), 1))
            table = pricer.edge(edge) if allowed is None else pricer.edge(edge, allowed[src], allowed[node])
            if position == 0 and (src, node) in graph.in_place:  # an in-place write's path: never moved
                table = table + graph.in_place_mask(src, node)
            edges.append((index[src], index[node], table))
            edge_inputs.append((src, node, position))
            edge_prices.append(edge)
    return edges, edge_inputs, edge_prices



def alike_consumers(graph: StrategyGraph, nodes, params) -> dict[tuple[fx.Node, fx.Node, int], int]:
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



def copy_readers(graph: StrategyGraph, on_grad_path: set[fx.Node]) -> dict[fx.Node, frozenset | None]:
    """Per parameter placeholder captured under a mixed-precision policy: the reads (consumer,
    input position) whose backward saves it, each holding its share of the working copy
    (``EdgePricer.working_copy``); None where a reader is no problem edge (a view that follows
    it, the graph's output): then its ZeRO node holds the copy (the module docstring)."""
    out: dict[fx.Node, frozenset | None] = {}
    cache: dict = {}
    for node in graph.nodes:
        if node.name not in graph.captured.params or META_KEY not in node.meta:
            continue
        saving: set | None = set()
        for user in node.users:
            if user not in graph.nodes or graph.nodes[user].follows is not None or user.op == "placeholder":
                saving = None
                break
            sources = tensor_inputs(user)
            roles = saved_roles(user, cache, tuple(s in on_grad_path for s in sources))
            # an op meta tensors cannot run is assumed to save what it reads (saved_values: the worst)
            saving.update((user, i) for i, s in enumerate(sources)
                          if s is node and (roles is None or roles.inputs.get(i)))
        out[node] = None if saving is None else frozenset(saving)
    return out


def working_copy_memory(edge_inputs: list, edge_prices: list, pricer: EdgePricer,
                        readers: dict[fx.Node, frozenset | None]) -> dict[int, np.ndarray]:
    """``SolveProblem.edge_memory``: problem edge -> its table of working-copy bytes, for the
    reads of a parameter whose backward saves it (``copy_readers``)."""
    out = {}
    for e, ((src, dst, position), edge) in enumerate(zip(edge_inputs, edge_prices)):
        if readers.get(src) and (dst, position) in readers[src]:
            out[e] = pricer.working_copy(edge, src.meta[META_KEY], len(readers[src]))
    return out
