"""Codegen: a captured graph plus one chosen strategy per node -> one rank's program.

The program is an ``fx.GraphModule`` over local shards. Each op runs as its strategy
says (``rules.run_local``: shape arguments localized, a kernel where one is named,
baked in for this rank's mesh coordinate). Where a producer's placement differs from
what its consumer needs, a :class:`Reshard` node moves the value; ``print(gm.code)``
shows each one by the collectives it performs.

Gradients. A Reshard is DTensor's ``from_local -> redistribute -> to_local``, whose
backward is the dual collective. What the consumer's local gradient *means* is declared
per edge (``grad_placements``): a replicated input of an op whose output differs across
an axis (it is split or partial there) receives only this device's contribution to its
gradient — a Partial — which DTensor sums on the way back (Megatron's "f": identity
forward, all-reduce backward). So a replicated parameter used by a batch-split op gets
its gradient all-reduced over the data-parallel axis, a sharded one (ZeRO-3) gets it
reduce-scattered, with no special case for either.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils import _pytree as pytree

from passes import rules
from passes.placements import Spec, spec_str
from passes.strategies import StrategyGraph, tensor_inputs
from passes.strategy import OpInfo, ShardingStrategy


def gradient_spec(needed: Spec, outputs: Sequence[Spec]) -> Spec:
    """Placement of the local gradient an op hands back for an input laid out as ``needed``."""
    grad = []
    for axis, p in enumerate(needed):
        if isinstance(p, Shard):
            grad.append(p)
        elif isinstance(p, Partial):
            grad.append(Replicate())  # each part of a sum gets the whole gradient
        elif all(isinstance(out[axis], Replicate) for out in outputs):
            grad.append(Replicate())  # every device computed the same thing
        else:
            grad.append(Partial())  # this device's share of the gradient
    return tuple(grad)


def collectives(src: Spec, dst: Spec) -> list[str]:
    """What moving ``src`` to ``dst`` costs, axis by axis, in collective names."""
    names = []
    for axis, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        kind = {
            (Shard, Replicate): "all_gather", (Partial, Replicate): "all_reduce",
            (Partial, Shard): "reduce_scatter", (Shard, Shard): "all_to_all",
            (Replicate, Shard): "slice", (Replicate, Partial): "zero_others",
        }.get((type(a), type(b)), "redistribute")
        names.append(f"{kind}{axis}")
    return names


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = DTensor.from_local(x, self.mesh, self.src, run_check=False)
        if self.mid != self.src:
            d = d.redistribute(self.mesh, self.mid)
        local = d.to_local(grad_placements=self.mid_grad)
        coord = self.mesh.get_coordinate()
        if any(coord[a] != 0 for a in self.zero_axes):
            local = local * 0
        return local

    def extra_repr(self) -> str:
        moves = ", ".join(collectives(self.src, self.dst)) or "no data moves"
        return f"{spec_str(self.src)} -> {spec_str(self.dst)} ({moves}; gradient {spec_str(self.grad)})"


class LocalKernel(nn.Module):
    """A rule's local kernel, bound to one node's strategy and this rank's coordinate."""

    def __init__(self, info: OpInfo, strategy: ShardingStrategy, ctx: rules.LocalContext):
        super().__init__()
        self.info, self.strategy, self.ctx = info, strategy, ctx

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return rules.run_local(self.info, self.strategy, _leaves_in_order(self.info, args, kwargs), self.ctx)

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
) -> RankProgram:
    """Build this rank's program (the rank is the caller's: ``mesh.get_coordinate()``).

    A value moved to the same layout for several consumers is moved once and shared,
    except the placeholders named in ``gather_per_use`` (ZeRO-3 parameters), which are
    gathered again at each use so that no whole copy outlives its consumer. With a
    ``part``, only that piece of the graph is built (a pipeline stage). ``mesh`` None:
    a single device (a pipeline stage with no intra-op axes). ``batch_grad_sync``: a
    replicated parameter whose every use leaves it as it is and sends back a share of
    its gradient (data parallelism) has those shares summed once per step for all such
    parameters together (``RankProgram.grad_sync``), as DDP's buckets do, instead of
    one all-reduce per use. ``storage``: placeholders kept in another layout than their
    strategy's (ZeRO-1/2 parameters: stored split, used whole); they are moved once.
    """
    mesh_shape = tuple(mesh.shape) if mesh is not None else ()
    if mesh_shape != graph.mesh_shape:
        raise ValueError(
            f"autopar: the strategies were listed for a mesh of shape {graph.mesh_shape}, "
            f"found a device mesh of shape {mesh_shape}; build the strategy graph for this mesh"
        )
    ctx = rules.LocalContext(mesh_shape, tuple(mesh.get_coordinate()) if mesh is not None else ())
    out = fx.Graph()
    root = nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    specs: dict[fx.Node, tuple[Spec, ...]] = {}
    input_specs: dict[str, Spec] = {}
    counter = iter(range(1 << 30))

    def add_module(prefix: str, module: nn.Module) -> str:
        name = f"{prefix}_{next(counter)}"
        root.add_module(name, module)
        return name

    storage = storage or {}

    def stored(node: fx.Node) -> Spec:
        return storage.get(node.name) or output_spec(graph, choice, node)

    moved: dict[tuple[fx.Node, Spec, Spec], fx.Node] = {}
    grad_sync = _deferred_grad_sync(graph, choice, part, stored) if batch_grad_sync else {}

    def fetch(src: fx.Node, needed: Spec | None, grad: Spec | None) -> fx.Node:
        have = specs[src][0]
        node = env[src]
        if needed is None or (needed == have and all(
            not (isinstance(g, Partial) and isinstance(h, Replicate)) for g, h in zip(grad, have)
        )):
            return node
        if src.name in grad_sync and needed == have:
            return node  # its gradient shares are summed after backward
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
            if isinstance(x, fx.Node) and x in specs:
                done = sent(specs[x][0])
                outputs.append(fetch(x, done, done))
                output_specs.append(done)
            else:
                outputs.append(env[x] if isinstance(x, fx.Node) else x)
                output_specs.append(None)
        return outputs, output_specs

    def receive(node: fx.Node, spec: Spec | None) -> None:
        env[node] = out.placeholder(node.name)
        env[node].meta = dict(node.meta)
        if spec is not None:
            specs[node] = (spec,)
            input_specs[node.name] = spec

    if part is not None:
        for node in part.inputs:
            spec = stored(node) if node in graph.nodes else None
            receive(node, spec if node.op == "placeholder" or spec is None else sent(spec))

    for node in graph.captured.graph.nodes:
        if part is not None and node.op != "output" and node not in part.nodes:
            continue
        if node.op == "placeholder":
            receive(node, stored(node) if node in graph.nodes else None)
        elif node.op == "call_function" and node.target is operator.getitem:
            producer, index = node.args
            env[node] = out.call_function(operator.getitem, (env[producer], index))
            if producer in specs:
                specs[node] = (specs[producer][index],)
        elif node.op == "call_function":
            ns = graph[node]
            strategy = ns.strategies[choice[node]]
            sources = tensor_inputs(node)
            local_inputs = [
                fetch(src, need, None if need is None else gradient_spec(need, strategy.outputs))
                for src, need in zip(sources, strategy.inputs)
            ]
            args, kwargs = ns.info.fill(local_inputs)
            rule = rules.rule_for(node.target)
            if strategy.kernel is not None:
                target = add_module(f"{strategy.kernel}", LocalKernel(ns.info, strategy, ctx))
                env[node] = out.call_module(target, args, kwargs)
            else:
                if rule is not None and rule.localize is not None:
                    args, kwargs = rule.localize(ns.info, strategy, args, kwargs, ctx)
                env[node] = out.call_function(node.target, args, kwargs)
            specs[node] = strategy.outputs
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
    return RankProgram(gm, input_specs, output_specs, grad_sync)


def _deferred_grad_sync(
    graph: StrategyGraph, choice: dict[fx.Node, int], part: Part | None, stored
) -> dict[str, tuple[int, ...]]:
    """Parameters whose gradient can be summed after backward, and over which axes: every
    use takes the parameter as stored, and on each replicated axis either every use or no
    use sends back a share (mixing shares with whole gradients could not be summed)."""
    result = {}
    for node in graph.captured.nodes("placeholder"):
        if node.name not in graph.captured.params or node not in graph.nodes:
            continue
        have = stored(node)
        uses = [u for u in node.users if u in graph.nodes and (part is None or u in part.nodes)]
        grads = []
        for user in uses:
            strategy = graph[user].strategies[choice[user]]
            for src, need in zip(tensor_inputs(user), strategy.inputs):
                if src is node:
                    if need != have:
                        grads = None
                        break
                    grads.append(gradient_spec(need, strategy.outputs))
            if grads is None:
                break
        if not grads:
            continue
        axes = []
        for axis, p in enumerate(have):
            shares = {isinstance(g[axis], Partial) for g in grads}
            if isinstance(p, Replicate) and shares == {True}:
                axes.append(axis)
            elif isinstance(p, Replicate) and len(shares) > 1:
                axes = None
                break
        if axes:
            result[node.name] = tuple(axes)
    return result
