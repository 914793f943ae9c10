"""Codegen: a captured graph plus one chosen strategy per node -> one rank's program.

The program is an ``fx.GraphModule`` over local shards. Each op runs as its strategy
says (``rules.run_local``: shape arguments localized, a kernel where one is named,
baked in for this rank's mesh coordinate). Where a producer's placement differs from
what its consumer needs, a :class:`Reshard` node moves the value; ``print(gm.code)``
shows each one by the collectives it performs.

Gradients. A Reshard's backward is the dual collective: a move on one mesh axis calls
torch.distributed directly (``autopar.passes.lowering.collectives``), others are DTensor's ``from_local
-> redistribute -> to_local``. What the consumer's local gradient *means* is declared
per edge (``grad``): a replicated input of an op whose output differs across an axis
(it is split or partial there) receives only this device's share of its gradient — a
Partial — which is summed on the way back (Megatron's "f": identity forward,
all-reduce backward). So a replicated parameter used by a batch-split op gets its
gradient summed over the data-parallel axis, a sharded one (ZeRO-3) gets it
reduce-scattered, with no special case for either. Shares are not summed where they
arise when they can travel further up unreduced (``gradient_shares``): through ops
replicated on that axis, to the parameters, where all of them are summed once per step
(``RankProgram.grad_sync``, DDP's buckets). Parameters stored split and used whole are
gathered a bucket per layer (``plan_buckets``, ``autopar.passes.lowering.buckets``), as FSDP does.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.costmodels.comm import axis_move
from autopar.passes import randomness, rules
from autopar.passes.rules import registry
from autopar.passes.rules.random import random_ordinals
from autopar.passes.exchange import MeshExchange
from autopar.passes.lowering import buckets
from autopar.passes.lowering.agreement import agree_before_first_run
from autopar.passes.lowering.buckets import Gather, GatherBucket
from autopar.passes.lowering.collectives import Axis, AxisMove, grad_side
from autopar.passes.layers import segments
from autopar.passes.placements import Spec, gradient_spec, spec_str
from autopar.passes.strategy_graph import StrategyGraph, read_after, tensor_inputs, write_path
from autopar.passes.op_strategies import OpInfo, ShardingStrategy


def collectives(src: Spec, dst: Spec) -> list[str]:
    """What moving ``src`` to ``dst`` does, axis by axis: each axis's move (``axis_move``,
    the cost model's table) with the axis's number, ``all_gather1``."""
    return [f"{axis_move(a, b)}{axis}" for axis, (a, b) in enumerate(zip(src, dst)) if a != b]


class Reshard(nn.Module):
    """Move a local shard from one placement to another, differentiably (see module doc)."""

    def __init__(self, mesh: DeviceMesh, src: Spec, dst: Spec, grad: Spec):
        super().__init__()
        self.mesh, self.src, self.dst, self.grad = mesh, src, dst, grad
        # DTensor will not redistribute *to* a Partial; those axes go to Replicate first,
        # then every device but the first along the axis holds zeros (an exact split).
        self.zero_axes = [
            a for a, (s, d) in enumerate(zip(src, dst)) if isinstance(d, Partial) and not isinstance(s, Partial)
        ]
        self.mid = tuple(Replicate() if a in self.zero_axes else p for a, p in enumerate(dst))
        # only the first device's copy reaches the output there: its gradient is a share
        self.mid_grad = tuple(Partial() if a in self.zero_axes else g for a, g in enumerate(grad))
        # one collective each way per axis: torch.distributed directly (passes/collectives.py),
        # axis by axis; DTensor for the rest
        self.fast = AxisMove.chain(mesh, src, dst, grad) if mesh is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast is not None:
            for step in self.fast:
                x = step(x)
            return x
        d = DTensor.from_local(x, self.mesh, self.src, run_check=False)
        if self.mid != self.src:
            d = d.redistribute(self.mesh, self.mid)
        local = d.to_local(grad_placements=self.mid_grad)
        coord = self.mesh.get_coordinate()
        if any(coord[a] != 0 for a in self.zero_axes):
            local = local * 0
        return local

    def axis_calls(self) -> list[tuple[int | None, str]]:
        """The collectives it calls, each with its mesh axis (``agreement``)."""
        return [(a, f"{spec_str(self.src)} -> {spec_str(self.dst)}")
                for a, (s, d) in enumerate(zip(self.src, self.dst)) if s != d]

    def extra_repr(self) -> str:
        moves = ", ".join(collectives(self.src, self.dst)) or "no data moves"
        return f"{spec_str(self.src)} -> {spec_str(self.dst)} ({moves}; gradient {spec_str(self.grad)})"


class _ScaledGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class GradientShare(nn.Module):
    """The identity, whose backward hands on ``factor`` (1 / ranks) of the gradient: a whole
    gradient made a share, for a step that sums it over those ranks (``lower``'s ``sync_as``)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaledGradient.apply(x, self.factor)

    def extra_repr(self) -> str:
        return f"gradient x {self.factor:g}"


class LocalKernel(nn.Module):
    """A rule's local kernel, bound to one node's strategy and this rank's coordinate;
    ``stream``: a random op's ordinal among its graph's random ops (``random_ordinals``)."""

    def __init__(self, info: OpInfo, strategy: ShardingStrategy, ctx: rules.LocalContext, stream: int | None = None):
        super().__init__()
        self.info, self.strategy, self.ctx, self.stream = info, strategy, ctx, stream

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with randomness.op(self.stream) if self.stream is not None else contextlib.nullcontext():
            return rules.run_local(self.info, self.strategy, _leaves_in_order(self.info, args, kwargs), self.ctx)

    def axis_calls(self) -> list[tuple[int | None, str]]:
        """A kernel that trades rows with its peers picks its axes at run time (None: any)."""
        return [(None, f"{self.strategy.kernel} of {self.info.name}")] if registry.communicates(self.strategy.kernel) else []

    def extra_repr(self) -> str:
        return f"{self.strategy.kernel}: {self.info.name} {self.strategy}"


def _leaves_in_order(info: OpInfo, args: tuple, kwargs: dict) -> list[Any]:
    leaves = pytree.tree_leaves((args, kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


@dataclass
class RankProgram:
    """One rank's program and the placements at its boundary."""

    gm: fx.GraphModule
    input_specs: dict[str, Spec]  # placeholder name -> placement of its local shard
    output_specs: list[Spec | None]  # per graph output (None: not a tensor)
    # parameter placeholder -> mesh axes over which its gradient comes out of backward as
    # this device's share, to be summed once per step for all parameters together
    grad_sync: dict[str, tuple[int, ...]] = field(default_factory=dict)
    regathers: bool = False  # ZeRO-3 buckets freed after use: run the program inside ``saving()``
    gathers: bool = False  # any bucket: its gathers and reduce-scatters overlap compute inside ``saving()``
    overlap: buckets.Overlap = field(default_factory=buckets.Overlap, repr=False, compare=False)

    @contextlib.contextmanager
    def saving(self, observe: Callable[[torch.Tensor, bool], None] | None = None,
               overlap_backward: bool = False) -> Iterator[None]:
        """The context to run the program (forward) in: gathered weights that it frees are
        saved for backward as references and gathered again, buckets are gathered one
        ahead (``autopar.passes.lowering.buckets``); ``observe(tensor, is_weight)`` sees
        every tensor kept for backward. ``overlap_backward``: for a ``backward()`` (not
        ``autograd.grad``) that can hold one bucket more: re-gathers are prefetched too, and
        buckets' gradients reduce-scattered while backward runs land in ``.grad`` when the
        next bucket's starts or backward ends."""
        with contextlib.ExitStack() as stack:
            if self.gathers:
                stack.enter_context(self.overlap.forward(overlap_backward, self.grad_sync))
            if self.regathers or observe is not None:
                stack.enter_context(buckets.saving(observe))
            yield


@dataclass
class Part:
    """A piece of the graph (a pipeline stage): its op nodes, the values it receives
    (placeholders of the model, or values made by earlier pieces) and those it sends."""

    nodes: set[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]


def sent(spec: Spec) -> Spec:
    """Values leave a program as shards or replicas: a pending sum is reduced on the way out,
    since whatever reads them (the loss, the user, the next stage) expects values."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in spec)


def output_spec(graph: StrategyGraph, choice: dict[fx.Node, int], node: fx.Node) -> Spec:
    ns = graph[node]
    if ns.follows is not None:
        producer, index = ns.follows
        return graph[producer].strategies[choice[producer]].outputs[index]
    return ns.strategies[choice[node]].outputs[0]


def lower(
    graph: StrategyGraph,
    choice: dict[fx.Node, int],
    mesh: DeviceMesh | None,
    gather_per_use: frozenset[str] = frozenset(),
    part: Part | None = None,
    batch_grad_sync: bool = True,
    storage: dict[str, Spec] | None = None,
    reduce_outputs: bool = True,
    sync_as: dict[str, tuple[int, ...]] | None = None,
) -> RankProgram:
    """Build this rank's program (the rank is the caller's: ``mesh.get_coordinate()``).

    A value moved to the same layout for several consumers is moved once and shared.
    Parameters stored split and used whole — the placeholders named in
    ``gather_per_use`` (ZeRO-3) and those in ``storage`` (ZeRO-1/2: kept in another
    layout than their strategy's) — are gathered in buckets (``autopar.passes.lowering.buckets``), one per
    segment of the graph (a repeated layer, or the stretch between layers): ZeRO-3 ones
    freed after use and gathered again in backward, ZeRO-1/2 ones kept for backward.
    With a ``part``, only that piece of the graph is built (a pipeline
    stage). ``mesh`` None: a single device (a pipeline stage with no intra-op axes).
    ``batch_grad_sync``: gradients that come back as this device's share on a
    replicated axis (data parallelism) are passed up unreduced wherever every path
    allows (``gradient_shares``) and summed once per step at the parameters, for all
    of them together (``RankProgram.grad_sync``), as DDP's buckets do.
    ``reduce_outputs`` False: outputs that are pending sums leave as they are (Partial in
    ``output_specs``), for a caller that reduces them itself.
    ``sync_as`` (parameter fqn -> axes): the sums a step already makes of the gradients
    (another capture's ``grad_sync``, by fqn), so that every program of a plan accumulates
    into the same ``.grad`` alike: shares pass up only on those axes, and a parameter whose
    gradient comes back whole on one of them hands back 1/size of it (``GradientShare``).
    """
    mesh_shape = tuple(mesh.shape) if mesh is not None else ()
    if mesh_shape != graph.mesh_shape:
        raise ValueError(
            f"autopar: the strategies were listed for a mesh of shape {graph.mesh_shape}, "
            f"found a device mesh of shape {mesh_shape}; build the strategy graph for this mesh"
        )
    ctx = rules.LocalContext(mesh_shape, tuple(mesh.get_coordinate()) if mesh is not None else (),
                             MeshExchange(mesh) if mesh is not None else None)
    flow = Flow(graph, choice, part, storage or {}, reduce_outputs)
    params = graph.captured.params
    allowed = None if sync_as is None else {(v, a) for v in flow.order if v.name in params
                                            for a in sync_as.get(params[v.name], ())}
    shared = gradient_shares(flow, batch_grad_sync, allowed)
    grad_sync = {
        v.name: axes for v in flow.order
        if v.op == "placeholder" and v.name in params
        and (axes := tuple(a for a in range(len(mesh_shape)) if (v, a) in shared))
    }
    whole = {}  # parameter placeholder -> 1 / ranks of the axes it is summed over but comes back whole on
    if sync_as is not None:
        for v in flow.order:
            if v in flow.received and v.name in params and flow.grad.get(v, False) and sync_as.get(params[v.name]):
                missing = [a for a in sync_as[params[v.name]] if a not in grad_sync.get(v.name, ())]
                if missing:
                    whole[v] = 1.0 / math.prod(mesh_shape[a] for a in missing)
                grad_sync[v.name] = tuple(sync_as[params[v.name]])
    bucket_of = plan_buckets(flow, shared, gather_per_use, storage or {}) if mesh is not None else {}
    streams = random_ordinals(graph.captured.gm.graph)  # each random op's stream of draws
    out = fx.Graph()
    root = nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    counter = iter(range(1 << 30))

    def add_module(prefix: str, module: nn.Module) -> str:
        name = f"{prefix}_{next(counter)}"
        root.add_module(name, module)
        return name

    moved: dict[tuple[fx.Node, Spec, Spec], fx.Node] = {}
    gathered: dict[tuple[fx.Node, tuple], fx.Node] = {}
    moved_input: set[fx.Node] = set()  # ops that read their first tensor input moved (a copy)

    def fetch(src: fx.Node, consumer: fx.Node | None, needed: Spec | None) -> fx.Node:
        node = env[src]
        if needed is None or src not in flow.spec:
            return node
        have = flow.spec[src]
        grad = flow.edge_grad(src, consumer, needed, shared)
        if needed == have and grad == tuple(grad_side(p) for p in have):
            return node
        bucket = bucket_of.get((src, consumer))
        if bucket is not None:
            if (src, bucket.key) not in gathered:
                call = out.call_module(add_module(bucket.prefix, bucket.module(mesh)),
                                       tuple(env[p] for p in bucket.params))
                for i, p in enumerate(bucket.params):
                    gathered[(p, bucket.key)] = out.call_function(operator.getitem, (call, i))
            return gathered[(src, bucket.key)]
        key = (src, needed, grad)
        if key in moved and src.name not in gather_per_use:
            return moved[key]
        name = "_".join(collectives(have, needed)) or "grad_reduce"
        target = add_module(name, Reshard(mesh, have, needed, grad))
        moved[key] = out.call_module(target, (node,))
        return moved[key]

    def emit(values: list[Any]) -> tuple[list[Any], list[Spec | None]]:
        outputs, output_specs = [], []
        for x in values:
            if isinstance(x, fx.Node) and x in flow.spec:
                done = sent(flow.spec[x]) if reduce_outputs else flow.spec[x]
                outputs.append(fetch(x, None, done))
                output_specs.append(done)
            else:
                outputs.append(env[x] if isinstance(x, fx.Node) else x)
                output_specs.append(None)
        return outputs, output_specs

    for node in flow.order:
        if node in flow.received:
            env[node] = out.placeholder(node.name)
            env[node].meta = dict(node.meta)
            if node in whole:
                env[node] = out.call_module(add_module("gradient_share", GradientShare(whole[node])), (env[node],))
                env[node].meta = dict(node.meta)
        elif node.op == "call_function" and node.target is operator.getitem:
            producer, index = node.args
            env[node] = out.call_function(operator.getitem, (env[producer], index))
            env[node].meta["autopar_node"] = node.name  # autopar.passes.lowering.recompute finds layers by it
        elif node.op == "call_function":
            ns = graph[node]
            strategy = ns.strategies[choice[node]]
            local_inputs = [fetch(src, node, need) for src, need in zip(tensor_inputs(node), strategy.inputs)]
            first = tensor_inputs(node)[0] if local_inputs else None
            if first in flow.spec and strategy.inputs[0] is not None and strategy.inputs[0] != flow.spec[first]:
                moved_input.add(node)  # its data moves in forward: the op reads a copy
            check_write_reaches(node, moved_input, flow.order)
            args, kwargs = ns.info.fill(local_inputs)
            rule = rules.rule_for(node.target)
            if strategy.kernel is not None:
                target = add_module(f"{strategy.kernel}", LocalKernel(ns.info, strategy, ctx, streams.get(node)))
                env[node] = out.call_module(target, args, kwargs)
            else:
                if rule is not None and rule.localize is not None:
                    args, kwargs = rule.localize(ns.info, strategy, args, kwargs, ctx)
                env[node] = out.call_function(node.target, args, kwargs)
            env[node].meta["autopar_node"] = node.name
            written = set(write_path(node)[1:])  # copies moved from these before the write are stale now
            for key in [k for k in moved if k[0] in written]:
                del moved[key]
        elif node.op == "output":
            if part is not None:
                outputs, output_specs = emit(list(part.outputs))
                out.output(tuple(outputs))
            else:
                flat, tree = pytree.tree_flatten(node.args[0])
                outputs, output_specs = emit(flat)
                out.output(pytree.tree_unflatten(outputs, tree))
        else:
            raise ValueError(f"autopar: cannot lower a graph node of kind {node.op} ({node.name})")
    out.lint()
    gm = fx.GraphModule(root, out, class_name="RankProgram")
    input_specs = {n.name: flow.spec[n] for n in flow.order if n in flow.received and n in flow.spec}
    regathers = any(not b.keep for b in bucket_of.values())
    agree_before_first_run(gm, grad_sync, mesh)
    return RankProgram(gm, input_specs, output_specs, grad_sync, regathers, gathers=bool(bucket_of))


def check_write_reaches(node: fx.Node, moved_input: set[fx.Node], order: list[fx.Node]) -> None:
    """An in-place write (``copy_``, ``fill_``, ...) into a value, or into a view of one,
    must land in the tensor later readers read. The planner keeps such a write's path where
    its values lie (``StrategyGraph.in_place``); a plan that moves the written value (or
    the base it views) to another placement on the way anyway would land the write in a
    moved copy, and the readers after it would read the unwritten value: silently wrong,
    so an error. ``moved_input``: the ops lowered so far that read their first tensor input moved."""
    path = write_path(node)
    if not path:
        return
    later = read_after(path, {n: i for i, n in enumerate(order)})
    moved = [n.name for n in path[:-1] if n in moved_input]
    if moved and later:
        raise ValueError(
            f"autopar: {node.name} ({node.target}) writes in place into {path[1].name}, a view of {path[-1].name}, "
            f"which this plan moves to another placement on the way (read moved by {moved}): the write would "
            f"land in a copy and {[u.name for u in later[:3]]} would read the unwritten value. Expected the plan "
            "to keep an in-place write's path where its values lie (StrategyGraph.in_place): a plan made by "
            "another planner version or edited by hand breaks it; plan again, or write the model's op out of place")


class Flow:
    """The values of one program in order, each one's placement, and who reads it how."""

    def __init__(self, graph: StrategyGraph, choice: dict[fx.Node, int], part: Part | None,
                 storage: dict[str, Spec], reduce_outputs: bool = True):
        self.graph, self.choice = graph, choice
        captured = graph.captured
        self.order: list[fx.Node] = []  # program order: received values first, then ops, the output last
        self.received: set[fx.Node] = set()  # the program's placeholders
        self.spec: dict[fx.Node, Spec] = {}  # placement of each tensor value
        self.outputs: dict[fx.Node, tuple[Spec, ...]] = {}  # op -> placements of all its outputs
        self.readers: dict[fx.Node, list[tuple[fx.Node | None, Spec | None]]] = {}  # None: read by the output
        self.grad: dict[fx.Node, bool] = {}  # whether a gradient flows back into the value

        def stored(node: fx.Node) -> Spec:
            return storage.get(node.name) or output_spec(graph, choice, node)

        def receive(node: fx.Node, spec: Spec | None) -> None:
            self.order.append(node)
            self.received.add(node)
            if spec is not None:
                self.spec[node] = spec
            if node.op != "placeholder":  # a value made by an earlier stage
                self.grad[node] = _floating(node)
            elif node.name in captured.params:
                self.grad[node] = True
            else:  # user inputs (buffers are state: they take no gradient)
                self.grad[node] = node.name in captured.user_inputs and _floating(node)

        if part is not None:
            for node in part.inputs:
                spec = stored(node) if node in graph.nodes else None
                receive(node, spec if node.op == "placeholder" or spec is None else sent(spec))
        for node in captured.graph.nodes:
            if part is not None and node.op != "output" and node not in part.nodes:
                continue
            if node.op == "placeholder":
                receive(node, stored(node) if node in graph.nodes else None)
                continue
            self.order.append(node)
            if node.op == "call_function" and node.target is operator.getitem:
                producer, index = node.args
                if producer in self.outputs:
                    self.spec[node] = self.outputs[producer][index]
                self.grad[node] = self.grad.get(producer, False) and _floating(node)
            elif node.op == "call_function":
                strategy = graph[node].strategies[choice[node]]
                self.outputs[node] = strategy.outputs
                self.spec[node] = strategy.outputs[0]
                sources = tensor_inputs(node)
                for src, need in zip(sources, strategy.inputs):
                    self.readers.setdefault(src, []).append((node, need))
                self.grad[node] = _floating(node) and any(self.grad.get(src, False) for src in sources)
            elif node.op == "output":
                values = part.outputs if part is not None else pytree.tree_leaves(node.args[0])
                for x in values:
                    if isinstance(x, fx.Node) and x in self.spec:
                        spec = sent(self.spec[x]) if reduce_outputs else self.spec[x]
                        self.readers.setdefault(x, []).append((None, spec))

    def edge_grad(self, src: fx.Node, consumer: fx.Node | None, needed: Spec,
                  shared: set[tuple[fx.Node, int]]) -> Spec:
        """How the gradient for ``src`` comes back along this edge, before moving: the
        consumer's local gradient, except on axes where ``src`` takes shares unreduced."""
        if not self.grad.get(src, False):
            return tuple(grad_side(p) for p in self.spec[src])  # no gradient: nothing to move back
        if consumer is None:
            return tuple(grad_side(p) for p in needed)
        mine = {a for a in range(len(needed)) if (consumer, a) in shared}
        grad = gradient_spec(needed, self.outputs[consumer], mine)
        return tuple(Replicate() if (src, a) in shared else g for a, g in enumerate(grad))

    def share_edge(self, consumer: fx.Node | None, needed: Spec | None, axis: int,
                   shared: set[tuple[fx.Node, int]]) -> bool | None:
        """Whether a reader hands back a share on ``axis`` (None: it hands back no gradient)."""
        if consumer is not None and not self.grad[consumer]:
            return None
        if consumer is None or needed is None or not isinstance(needed[axis], Replicate):
            return False
        return (consumer, axis) in shared or any(not isinstance(o[axis], Replicate) for o in self.outputs[consumer])


def _floating(node: fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in vals)


def gradient_shares(flow: Flow, batch_grad_sync: bool = True,
                    allowed: set[tuple[fx.Node, int]] | None = None) -> set[tuple[fx.Node, int]]:
    """(value, mesh axis) pairs whose gradient comes back as this device's share, unreduced.

    On an axis where a value is replicated but a reader's output differs (a batch split,
    a column-parallel layer), the reader hands back only this device's share of the
    gradient. Rather than all-reducing it there, a share may pass up the graph: through
    an op replicated on that axis (backward is linear in the output gradient, so shares
    in give shares out) to parameters, where they are summed once per step
    (``RankProgram.grad_sync``), or to values that take no gradient at all. A value
    takes shares on an axis when every reader hands back one and it can pass them on
    without a reduction anywhere; the largest such set is found by removing pairs that
    break these conditions until none does. ``allowed``: the only (parameter, axis) pairs
    that may be summed at the parameters (None: any).
    """
    captured = flow.graph.captured
    mesh_shape = flow.graph.mesh_shape

    def kind(v: fx.Node, axis: int) -> str | None:
        if not flow.grad.get(v, False) or v not in flow.spec or not isinstance(flow.spec[v][axis], Replicate):
            return None
        if mesh_shape[axis] == 1:
            return None
        if v.op == "placeholder" and v.name in captured.params and v in flow.received:
            return "sum" if batch_grad_sync and (allowed is None or (v, axis) in allowed) else None
        if v in flow.outputs and v not in flow.received and len(flow.outputs[v]) == 1:
            strategy = flow.graph[v].strategies[flow.choice[v]]
            if all(need is None or isinstance(need[axis], Replicate) for need in strategy.inputs):
                return "pass"
        return None

    kinds = {(v, a): k for v in flow.order for a in range(len(mesh_shape)) if (k := kind(v, a))}
    shared = set(kinds)

    def holds(v: fx.Node, axis: int) -> bool:
        edges = [flow.share_edge(c, need, axis, shared) for c, need in flow.readers.get(v, [])]
        edges = [e for e in edges if e is not None]
        if not all(edges) or (kinds[(v, axis)] == "sum" and not edges):
            return False
        if kinds[(v, axis)] == "pass":  # each input takes the shares, or gathers (reduce-scatters them)
            return all((src, axis) in shared or isinstance(flow.spec[src][axis], Shard)
                       for src in tensor_inputs(v) if flow.grad.get(src, False))
        return True

    work = list(shared)
    while work:
        v, axis = work.pop()
        if (v, axis) in shared and not holds(v, axis):
            shared.discard((v, axis))
            # its inputs now get a whole gradient from it; its readers can no longer pass to it
            work += [(u, axis) for u in v.all_input_nodes if (u, axis) in shared]
            work += [(c, axis) for c, _ in flow.readers.get(v, []) if c is not None and (c, axis) in shared]
    return shared


@dataclass
class Bucket:
    """Parameters gathered together (``autopar.passes.lowering.buckets``): over ``axes``, gradients reduced
    back where ``reduce`` says, freed after use unless ``keep``."""

    key: tuple
    axes: tuple[int, ...]
    reduce: tuple[bool, ...]
    keep: bool
    params: list[fx.Node] = field(default_factory=list)
    specs: list[Spec] = field(default_factory=list)

    @property
    def prefix(self) -> str:
        return "gather_bucket" + "".join(str(a) for a in self.axes)

    def module(self, mesh: DeviceMesh) -> GatherBucket:
        steps = [Gather(a, Axis.of(mesh, a), tuple(spec[a].dim for spec in self.specs), r)
                 for a, r in zip(self.axes, self.reduce)]
        return GatherBucket([p.name for p in self.params], steps, self.keep)


def plan_buckets(flow: Flow, shared: set[tuple[fx.Node, int]], per_use: frozenset[str],
                 storage: dict[str, Spec]) -> dict[tuple[fx.Node, fx.Node], Bucket]:
    """(parameter, reader) -> the bucket that gathers the parameter for that reader.

    A read qualifies when it only gathers: axes on which the parameter is split are
    made whole (innermost first, one all-gather each), the others stay as they are, and
    the gradient comes back as shares (reduce-scattered) or whole (sliced) there. Reads
    are bucketed by the segment of the graph the reader is in, so that backward reduces
    each segment's gradients as soon as they are complete; ZeRO-1/2 buckets are kept
    for backward, ZeRO-3 ones freed and gathered again.
    """
    params = flow.graph.captured.params
    segment = segments(flow.order, params)
    buckets: dict[tuple, Bucket] = {}
    chosen: dict[tuple[fx.Node, fx.Node], Bucket] = {}
    for v in flow.order:
        if v.name not in params or (v.name not in per_use and v.name not in storage) or v not in flow.spec:
            continue
        have = flow.spec[v]
        for consumer, need in flow.readers.get(v, []):
            if consumer is None or need is None:
                continue
            grad = flow.edge_grad(v, consumer, need, shared)
            axes = gathered_axes(have, need, grad)
            if axes is None:
                continue
            reduce = tuple(isinstance(grad[a], Partial) for a in axes)
            keep = v.name not in per_use
            key = (segment[consumer], axes, reduce, v.meta["val"].dtype, keep)
            bucket = buckets.setdefault(key, Bucket(key, axes, reduce, keep))
            if v not in bucket.params:
                bucket.params.append(v)
                bucket.specs.append(have)
            chosen[(v, consumer)] = bucket
    return chosen


def gathered_axes(have: Spec, need: Spec, grad: Spec) -> tuple[int, ...] | None:
    axes = []
    for a, (h, n, g) in enumerate(zip(have, need, grad)):
        if h == n:
            if g != grad_side(h):
                return None
        elif isinstance(h, Shard) and isinstance(n, Replicate) and (
            isinstance(g, Replicate) or (isinstance(g, Partial) and g.reduce_op == "sum")
        ):
            # a finer split of the same dim on an inner axis that stays would reorder pieces
            if any(isinstance(p, Shard) and p.dim == h.dim for p in need[a + 1 :]):
                return None
            axes.append(a)
        else:
            return None
    return tuple(axes) or None
